"""Live sessions over WebSocket, for clients that cannot reach Triton's gRPC sequence API (a browser, an LLM app
server): ``/v1/audio/voice-conversion/live`` (binary audio frames in, converted audio out as it is produced) and
``/v1/audio/speech/live`` (text deltas in, speech out). One socket is one session of a live model
(``cosyvoice_vc_live``, ``cosyvoice_tts_live``, or CosyVoice3's ``cosyvoice3_vc_live`` / ``cosyvoice3_tts_live`` for a
start with ``model: cosyvoice3``),
driven upstream by :class:`~..clients.live.AsyncLiveClient`: one
Triton sequence whose id the gateway draws (:class:`~.sessions.SequenceIds` with keys: the tenant's share of each
live model, ``--live-sessions-per-tenant``), so a client never names a sequence and never reaches another's.

The protocol (docs/live.md, "Over WebSocket"): a first JSON message ``session.start`` (the voice, the seed, the
output format; VC: the input's ``sample_rate`` and ``sample_format``), answered ``session.started``; then the
pieces (VC: binary frames of raw samples; TTS: ``input.text`` messages) and ``input.end``; the audio comes as
binary frames (or ``speech.audio.delta`` events), then ``speech.audio.done`` and a normal close. Anything wrong is
an ``error`` event in OpenAI's error shape, whose ``code`` (:data:`ERRORS`) names it, and a close code.

The key comes as ``Authorization: Bearer`` or, from a browser (which cannot set headers on a WebSocket), as the
subprotocol ``bearer.<key>`` offered beside :data:`SUBPROTOCOL`. A session is one request of its key for the
concurrency and rate limits, for as long as it is open. Bounds: at most ``live_max_pending`` pieces wait to go on
to Triton (one more cuts the session: ``input_overrun``), a piece of at most ``live_max_piece_s`` seconds of audio
(VC; frames shorter than ``live_min_piece_ms`` are gathered into one piece) or ``max_input_chars`` characters
(TTS), the start within ``header_timeout_s``, the input idle at most ``live_idle_s`` until ``input.end``. When the
socket goes away (closed, cut, or cut here), the session's end goes to Triton and what is left is cancelled
(:meth:`AsyncLiveClient._run`'s close), then its id and slot are freed."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Literal

import numpy as np
from fastapi import APIRouter, WebSocket
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.websockets import WebSocketDisconnect

from ..clients.live import TTS_LIVE_MODEL, VC_LIVE_MODEL, LiveStats, new_sequence_id
from ..clients.wire import VCError
from ..errors import AudioError
from ..frontend import audio as audio_in
from ..shapes import CV3_TTS_LIVE_MODEL, CV3_VC_LIVE_MODEL
from .audio import pcm16, reference_bytes
from .config import GatewayConfig
from .errors import GatewayError, check_text, error_body
from .limits import KeyLimiter, KeyRing, bounded_loads
from .metrics import GatewayMetrics
from .sessions import SequenceIds
from .tenants import PUBLIC, Namespace

log = logging.getLogger(__name__)

VC_LIVE_PATH, TTS_LIVE_PATH = "/v1/audio/voice-conversion/live", "/v1/audio/speech/live"
#: The subprotocol a browser offers (with ``bearer.<key>`` beside it); the gateway answers with it.
SUBPROTOCOL, KEY_PREFIX = "cosyvoice.live", "bearer."
#: Raw sample formats, in and out: signed 16-bit (OpenAI's ``pcm``) or 32-bit float, little-endian, mono.
SAMPLE_FORMATS = {"s16le": np.dtype("<i2"), "f32le": np.dtype("<f4")}
#: The rate of the audio out (the models' 24 kHz).
OUTPUT_RATE = audio_in.MEL_SR

#: error code -> (the HTTP-like status of its OpenAI error ``type``, the WebSocket close code)
ERRORS = {
    "invalid_api_key": (401, 1008),
    "rate_limit_exceeded": (429, 1013),
    "concurrency_limit_exceeded": (429, 1013),
    "too_many_sessions": (429, 1013),  # the tenant's share of the live model (or the gateway's open ids)
    "capacity": (503, 1013),  # the live model holds its most sessions (or Triton is not reachable)
    "missing_start": (400, 1008),
    "invalid_start": (400, 1008),
    "invalid_sample_rate": (400, 1008),
    "invalid_message": (400, 1008),
    "text_expected": (400, 1003),  # a binary frame where a JSON message belongs
    "binary_expected": (400, 1003),  # VC: a text frame that is no control message, where audio belongs
    "invalid_frame": (400, 1007),  # not whole samples, or samples that are not finite
    "piece_too_large": (413, 1009),
    "input_overrun": (429, 1013),
    "input_ended": (400, 1008),
    "session_idle": (408, 1008),
    "invalid_input": (400, 1008),  # the live model refused the input (a voice it does not know, bad text, ...)
    "backend_error": (502, 1011),
    "internal_error": (500, 1011),
}
_GATEWAY_CODES = {"too_many_sequences": "too_many_sessions"}
_END = object()


class LiveError(Exception):
    """A session cut with an ``error`` event: ``code`` one of :data:`ERRORS`."""

    def __init__(self, code: str, message: str, param: str | None = None):
        super().__init__(message)
        self.code, self.message, self.param = code, message, param

    @property
    def status(self) -> int:
        return ERRORS[self.code][0]

    @property
    def close_code(self) -> int:
        return ERRORS[self.code][1]

    @classmethod
    def of(cls, exc: GatewayError, default: str = "invalid_start") -> LiveError:
        code = _GATEWAY_CODES.get(exc.code or "", exc.code or "")
        return cls(code if code in ERRORS else default, exc.message, exc.param)


class _ClientGone(Exception):
    """The socket closed or broke: nothing more can be sent."""


class _Start(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["session.start"]
    voice: str | None = None  # one of the caller's voices (GET /v1/audio/voices)
    reference_audio: str | None = None  # or a recording (wav / flac / ogg) as base64 or a data: URL
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    output_format: Literal["s16le", "f32le"] = "s16le"
    stream_format: Literal["audio", "events"] = "audio"
    model: str | None = None  # as in POST /v1/audio/speech: cosyvoice3 is CosyVoice3, the others CosyVoice2


class _VCStart(_Start):
    sample_rate: int
    sample_format: Literal["s16le", "f32le"] = "s16le"


class _TTSStart(_Start):
    reference_text: str | None = None  # the recording's transcript (zero-shot; without it cross-lingual)


@dataclass
class _Plan:
    """A checked start: the model, what goes on its first piece, the formats."""

    model: str
    voice: dict
    start: _Start


def _json(text: str, config: GatewayConfig) -> dict:
    try:
        body = bounded_loads(text.encode("utf-8", "surrogatepass"), config.max_json_depth)
    except GatewayError as exc:
        raise LiveError("invalid_message", exc.message) from None
    if not isinstance(body, dict) or not isinstance(body.get("type"), str):
        raise LiveError("invalid_message", "a message is a JSON object with a \"type\"")
    return body


def plan(kind: str, body: dict, config: GatewayConfig, ns: Namespace = PUBLIC) -> _Plan:
    """The session a ``session.start`` message asks for, checked; :class:`LiveError` naming what is wrong."""
    if body.get("type") != "session.start":
        raise LiveError("missing_start", f"the first message must be session.start, got {str(body.get('type'))[:40]!r}")
    try:
        start = (_VCStart if kind == "vc" else _TTSStart).model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = str(first["loc"][0]) if first.get("loc") else None
        code = "invalid_sample_rate" if param == "sample_rate" else "invalid_start"
        raise LiveError(code, f"{param or 'session.start'}: {first.get('msg', 'invalid')}", param) from None
    try:
        for name in ("voice", "reference_text", "model"):
            check_text(getattr(start, name, None), name)
        if isinstance(start, _VCStart):
            try:
                audio_in.validate_sample_rate(start.sample_rate, name="sample_rate")
            except AudioError as exc:
                raise LiveError("invalid_sample_rate", str(exc), "sample_rate") from None
        if (start.voice is None) == (start.reference_audio is None):
            raise LiveError("invalid_start", "give voice (one of GET /v1/audio/voices) or reference_audio, one of "
                            "them", "voice")
        if start.reference_audio is not None:
            voice: dict = {"prompt": reference_bytes(start.reference_audio), "encoded": True}
            if getattr(start, "reference_text", None) is not None:
                voice["prompt_text"] = start.reference_text
        else:
            if getattr(start, "reference_text", None) is not None:
                raise LiveError("invalid_start", "reference_text needs reference_audio", "reference_text")
            voice = {"speaker_id": ns.scoped(start.voice)}
    except GatewayError as exc:
        raise LiveError.of(exc) from None
    model = _live_model(kind, start, config)
    if model == CV3_VC_LIVE_MODEL and start.seed is not None:
        raise LiveError("invalid_start", "seed: CosyVoice3's vocoder noise is the checkpoint's fixed buffer, there is "
                        "nothing to seed (leave seed out)", "seed")
    return _Plan(model, {**voice, "seed": start.seed}, start)


def _live_model(kind: str, start: _Start, config: GatewayConfig) -> str:
    """The live model of a start's kind and ``model`` (one of the gateway's ``models``; none: CosyVoice2's)."""
    cv2, cv3 = (VC_LIVE_MODEL, CV3_VC_LIVE_MODEL) if kind == "vc" else (TTS_LIVE_MODEL, CV3_TTS_LIVE_MODEL)
    if start.model is None:
        return cv2
    if start.model not in config.models:
        raise LiveError("invalid_start", f"model {start.model[:40]!r} is not served here; one of "
                        f"{', '.join(config.models)}", "model")
    return cv3 if start.model == "cosyvoice3" else cv2


class LiveSockets:
    """The two WebSocket routes (:meth:`router`) and their sessions. ``client``: what runs a session upstream (an
    object with ``convert_live`` / ``tts_live`` as :class:`~..clients.live.AsyncLiveClient` has them; default: one
    on ``config.triton_grpc``, made at the first session)."""

    def __init__(self, config: GatewayConfig, keys: KeyRing, limiter: KeyLimiter, metrics: GatewayMetrics,
                 sequences: SequenceIds | None = None, client=None):
        self.config, self.keys, self.limiter, self.metrics, self.sequences = config, keys, limiter, metrics, sequences
        self.client, self._own = client, client is None

    def router(self) -> APIRouter:
        router = APIRouter()

        @router.websocket(VC_LIVE_PATH)
        async def vc_live(ws: WebSocket):
            await self.serve(ws, "vc")

        @router.websocket(TTS_LIVE_PATH)
        async def tts_live(ws: WebSocket):
            await self.serve(ws, "tts")

        return router

    async def close(self) -> None:
        if self._own and self.client is not None:
            await self.client.close()
            self.client = None

    def _upstream(self):
        if self.client is None:
            from ..clients.live import AsyncLiveClient

            self.client = AsyncLiveClient(self.config.triton_grpc, timeout=self.config.backend_timeout_s,
                                          check_priority=False)
        return self.client

    # ------------------------------------------------------------------------------------------- the socket
    def _identify(self, ws: WebSocket) -> tuple[str, Namespace]:
        if not self.keys.enabled:
            return (ws.client.host if ws.client else "anonymous"), PUBLIC
        authorization = ws.headers.get("authorization")
        if authorization is None:
            offered = [p for p in ws.scope.get("subprotocols", ()) if p.startswith(KEY_PREFIX)]
            authorization = f"Bearer {offered[0][len(KEY_PREFIX):]}" if offered else None
        who = self.keys.identify(authorization)
        return who, Namespace(self.keys.tenant_of(who))

    async def serve(self, ws: WebSocket, kind: str) -> None:
        model = [VC_LIVE_MODEL if kind == "vc" else TTS_LIVE_MODEL]  # the session's, once its start is read
        try:
            await ws.accept(subprotocol=SUBPROTOCOL if SUBPROTOCOL in ws.scope.get("subprotocols", ()) else None)
        except (WebSocketDisconnect, RuntimeError, OSError):  # gone before the handshake's answer
            return
        sender = _Sender(ws)
        reason = "done"
        try:
            try:
                who, ns = self._identify(ws)
                self.limiter.acquire(who)
            except GatewayError as exc:
                raise LiveError.of(exc, "invalid_api_key") from None
            try:
                await self._session(ws, sender, kind, ns, model)
            finally:
                self.limiter.release(who)
        except LiveError as exc:
            reason = exc.code
            await sender.fail(exc)
        except _ClientGone:
            reason = "client_gone"
        except asyncio.CancelledError:  # the server stops (its session was ended upstream on the way out)
            reason = "cancelled"
            raise
        except Exception:  # a fault of the gateway's: this session ends, others go on
            log.exception("live session failed")
            reason = "internal_error"
            await sender.fail(LiveError("internal_error", "internal error of the gateway"))
        finally:
            self.metrics.live_ended.labels(model[0], reason).inc()

    async def _receive(self, ws: WebSocket, timeout: float | None, what: str) -> dict:
        # Not asyncio.wait_for: on Python 3.11 it returns a message that arrives as it is cancelled and drops the
        # cancellation, so a session cut while the client still sends would wait on for its idle time.
        receiving = asyncio.ensure_future(ws.receive())
        try:
            done, _ = await asyncio.wait({receiving}, timeout=timeout)
        finally:
            if not receiving.done():
                receiving.cancel()
        if not done:
            raise LiveError("session_idle", f"no {what} within {timeout:g} s: the session is closed")
        try:
            message = receiving.result()
        except (WebSocketDisconnect, RuntimeError):
            raise _ClientGone() from None
        if message["type"] == "websocket.disconnect":
            raise _ClientGone()
        return message

    async def _session(self, ws: WebSocket, sender: _Sender, kind: str, ns: Namespace, label: list[str]) -> None:
        config = self.config
        first = await self._receive(ws, config.header_timeout_s, "session.start")
        if first.get("text") is None:
            raise LiveError("missing_start", "the first message must be session.start (JSON in a text frame)")
        session = plan(kind, _json(first["text"], config), config, ns)
        label[0] = session.model
        client_id = new_sequence_id()
        sequence_id = self._open(ns, session.model, client_id)
        self.metrics.live_sessions.labels(session.model).inc()
        try:
            await self._run(ws, sender, kind, ns, session, client_id, sequence_id)
        finally:
            self.metrics.live_sessions.labels(session.model).dec()
            self._touch(ns, session.model, client_id, end=True)

    def _open(self, ns: Namespace, model: str, client_id: int) -> int:
        if self.sequences is None or ns.tenant is None:
            return client_id
        try:
            return self.sequences.upstream(ns.tenant, model, client_id, start=True)
        except GatewayError as exc:
            raise LiveError.of(exc, "too_many_sessions") from None

    def _touch(self, ns: Namespace, model: str, client_id: int, *, end: bool = False) -> None:
        """Keep the session's id open while the session lives (``end``: close it)."""
        if self.sequences is not None and ns.tenant is not None:
            self.sequences.upstream(ns.tenant, model, client_id, end=end)

    async def _run(self, ws: WebSocket, sender: _Sender, kind: str, ns: Namespace, session: _Plan, client_id: int,
                   sequence_id: int) -> None:
        config, start, model = self.config, session.start, session.model
        pending: asyncio.Queue = asyncio.Queue(maxsize=config.live_max_pending)
        stats = LiveStats()
        origins: list[int] = []  # per upstream request: the index of the input message that completed it

        async def pieces() -> AsyncIterator:
            while (piece := await pending.get()) is not _END:
                self._touch(ns, model, client_id)
                yield piece

        client = self._upstream()
        if kind == "vc":
            chunks = client.convert_live(pieces(), sample_rate=start.sample_rate, stats=stats,
                                         sequence_id=sequence_id, model=model, **session.voice)
        else:
            chunks = client.tts_live(pieces(), stats=stats, sequence_id=sequence_id, model=model, **session.voice)
        info = {"id": f"live-{client_id:016x}", "model": model, "sample_rate": OUTPUT_RATE,
                "output_format": start.output_format, "stream_format": start.stream_format,
                "max_pending": config.live_max_pending, "idle_timeout_s": config.live_idle_s}
        if kind == "vc":
            info.update(input={"sample_rate": start.sample_rate, "sample_format": start.sample_format},
                        max_piece_seconds=config.live_max_piece_s, min_piece_ms=config.live_min_piece_ms)
        else:
            info.update(max_piece_chars=config.max_input_chars)
        await sender.event({"type": "session.started", "session": info})
        pump = asyncio.ensure_future(self._pump(sender, chunks, start, model, ns, client_id, origins))
        reader = asyncio.ensure_future(self._read(ws, kind, start, pending, origins))
        try:
            await asyncio.wait({pump, reader}, return_when=asyncio.FIRST_COMPLETED)
            if not pump.done():  # the reader ended first: the client left or broke the protocol
                pump.cancel()
                try:
                    reader.result()
                except LiveError as exc:
                    await sender.fail(exc)  # at once: the upstream session's end (below) may take a while
                    raise
            pump.result()
            await sender.event({"type": "speech.audio.done",
                                "usage": {"input_tokens": 0, "output_tokens": 0, "total_tokens": 0},
                                "stats": {"pieces": stats.pieces, "chunks": stats.chunks,
                                          "audio_seconds": round(stats.audio_seconds, 6),
                                          "first_audio_s": stats.first_audio_s, "underruns": stats.underruns}})
            await sender.close(1000)
        except VCError as exc:
            raise _live_error(exc) from None
        finally:
            reader.cancel()
            for task in (pump, reader):  # the upstream session ends (its end sent, the rest cancelled) here
                with contextlib.suppress(BaseException):
                    await task

    async def _pump(self, sender: _Sender, chunks, start: _Start, model: str, ns: Namespace,
                    client_id: int, origins: list[int]) -> None:
        """Each chunk to the client as it comes, in the session's format (an event's ``piece``: the index of the
        input message whose arrival let the chunk be computed); the metrics per chunk."""
        dtype, first = SAMPLE_FORMATS[start.output_format], True
        async with contextlib.aclosing(chunks):
            async for chunk in chunks:
                self._touch(ns, model, client_id)
                self._observe(model, chunk, first)
                first = False
                wave = np.asarray(chunk.waveform, np.float32).reshape(-1)
                data = (pcm16(wave) if dtype.kind == "i" else wave.astype(dtype)).tobytes()
                if not data:
                    continue
                if start.stream_format == "events":
                    event = {"type": "speech.audio.delta", "audio": base64.b64encode(data).decode()}
                    if 0 <= chunk.piece < len(origins):
                        event["piece"] = origins[chunk.piece]
                    await sender.event(event)
                else:
                    await sender.binary(data)

    def _observe(self, model: str, chunk, first: bool) -> None:
        m = self.metrics
        if first:
            m.live_first_audio.labels(model).observe(max(0.0, chunk.elapsed_s))
        if chunk.latency_s == chunk.latency_s:  # not NaN
            m.live_chunk_latency.labels(model).observe(max(0.0, chunk.latency_s))
        if chunk.margin_s is not None and chunk.margin_s < 0:
            m.live_underruns.labels(model).inc()

    async def _read(self, ws: WebSocket, kind: str, start: _Start, pending: asyncio.Queue,
                    origins: list[int]) -> None:
        """The client's messages after the start: pieces onto ``pending`` until ``input.end``, and onto ``origins``
        the index of the message that completed each (counted from 0 after the start: frames, ``input.text``,
        ``input.end``); then only watch the socket (a piece after the end is refused)."""
        config, ended, index = self.config, False, -1
        dtype = SAMPLE_FORMATS[getattr(start, "sample_format", "f32le")]
        rate = getattr(start, "sample_rate", 0)
        gather = _Gather(round(config.live_min_piece_ms / 1000.0 * rate), int(config.live_max_piece_s * rate))
        while True:
            message = await self._receive(ws, None if ended else config.live_idle_s,
                                          "input (a piece or input.end)")
            data, text = message.get("bytes"), message.get("text")
            index += 1
            if ended and (data is not None or text is not None):
                raise LiveError("input_ended", "input.end was sent: no more input is taken")
            if data is not None:
                if kind != "vc":
                    raise LiveError("text_expected", "this session takes JSON text messages (input.text, "
                                    "input.end), not binary frames")
                ready = gather.add(self._samples(data, dtype, rate), index)
            else:
                body = self._control(kind, text or "")
                if body["type"] == "input.end":
                    ready, ended = [*gather.flush(index), (_END, index)], True
                else:
                    ready = [(body["text"], index)]
            for piece, origin in ready:
                if piece is not _END and not len(piece):
                    continue  # an empty piece: nothing to send
                try:
                    pending.put_nowait(piece)
                except asyncio.QueueFull:
                    raise LiveError("input_overrun", f"{config.live_max_pending} pieces are waiting to be "
                                    "converted, the most kept: send the input at real time (or slower)") from None
                origins.append(origin)

    def _samples(self, data: bytes, dtype: np.dtype, rate: int) -> np.ndarray:
        if len(data) % dtype.itemsize:
            raise LiveError("invalid_frame", f"a binary frame of {len(data)} bytes is not whole {dtype.itemsize}-byte "
                            "samples")
        n = len(data) // dtype.itemsize
        most = int(self.config.live_max_piece_s * rate)
        if n > most:
            raise LiveError("piece_too_large", f"a piece of {n / rate:.2f} s ({n} samples at {rate} Hz); at most "
                            f"{self.config.live_max_piece_s:g} s a piece: send the audio as it is recorded")
        samples = np.frombuffer(data, dtype)
        if dtype.kind == "f" and not np.isfinite(samples).all():
            raise LiveError("invalid_frame", "NaN or infinite samples: audio must be finite")
        return samples

    def _control(self, kind: str, text: str) -> dict:
        try:
            body = _json(text, self.config)
        except LiveError:
            if kind == "vc":
                raise LiveError("binary_expected", "audio goes in binary frames; a text frame is a JSON control "
                                "message (input.end)") from None
            raise
        kind_types = ("input.end",) if kind == "vc" else ("input.text", "input.end")
        if body["type"] not in kind_types:
            if kind == "vc" and body["type"] == "input.text":
                raise LiveError("binary_expected", "audio goes in binary frames, not in text messages")
            raise LiveError("invalid_message", f"unknown message type {body['type'][:40]!r}; expected one of "
                            f"{', '.join(kind_types)}")
        if body["type"] == "input.text":
            text_piece = body.get("text")
            if not isinstance(text_piece, str) or set(body) - {"type", "text"}:
                raise LiveError("invalid_message", "input.text carries \"text\", a string, and nothing else")
            try:
                check_text(text_piece, "text")
            except GatewayError as exc:
                raise LiveError("invalid_message", exc.message, "text") from None
            if len(text_piece) > self.config.max_input_chars:
                raise LiveError("piece_too_large", f"a text piece of {len(text_piece)} characters; at most "
                                f"{self.config.max_input_chars}")
        elif set(body) != {"type"}:
            raise LiveError("invalid_message", "input.end carries nothing but its type")
        return body


class _Gather:
    """Audio frames gathered into pieces of at least ``least`` samples (a browser's audio callbacks give a few ms
    each; one piece is one request to Triton), never over ``most``; a frame of ``least`` or more goes on alone
    when nothing waits. What goes on depends on the frames only, never on their timing."""

    def __init__(self, least: int, most: int):
        self.least, self.most, self.parts, self.size, self.last = max(0, least), most, [], 0, -1

    def _take(self) -> tuple[np.ndarray, int]:
        piece = self.parts[0] if len(self.parts) == 1 else np.concatenate(self.parts)
        self.parts, self.size = [], 0
        return piece, self.last

    def add(self, frame: np.ndarray, index: int = -1) -> list[tuple[np.ndarray, int]]:
        """The pieces ready once ``frame`` (the session's input message ``index``) has come, each with the index
        of its last frame."""
        out = [self._take()] if self.size and self.size + len(frame) > self.most else []
        self.parts.append(frame)
        self.size += len(frame)
        self.last = index
        if self.size >= self.least:
            out.append(self._take())
        return out

    def flush(self, index: int = -1) -> list[tuple[np.ndarray, int]]:
        """What is left, charged to the message ``index`` that ended the input."""
        return [(self._take()[0], index)] if self.size else []


def _live_error(exc: VCError) -> LiveError:
    """The live model's refusal or failure (its gRPC code, :func:`~..clients.live.live_error`) as an error event."""
    status = exc.status or ""
    if status.endswith("INVALID_ARGUMENT"):
        return LiveError("invalid_input", exc.message)
    if status.endswith(("UNAVAILABLE", "RESOURCE_EXHAUSTED")):
        return LiveError("capacity", f"the live model cannot take the session now; retry later ({exc.message})")
    return LiveError("backend_error", f"the live model failed: {exc.message}")


class _Sender:
    """Sends on one socket, one message at a time; a socket gone raises :class:`_ClientGone`."""

    def __init__(self, ws: WebSocket):
        self.ws, self.lock, self.closed = ws, asyncio.Lock(), False

    async def _send(self, message: dict) -> None:
        async with self.lock:
            if self.closed:
                raise _ClientGone()
            try:
                await self.ws.send(message)
            except (WebSocketDisconnect, RuntimeError, OSError):
                self.closed = True
                raise _ClientGone() from None

    async def event(self, event: dict) -> None:
        await self._send({"type": "websocket.send", "text": json.dumps(event, separators=(",", ":"))})

    async def binary(self, data: bytes) -> None:
        await self._send({"type": "websocket.send", "bytes": data})

    async def close(self, code: int, reason: str = "") -> None:
        with contextlib.suppress(_ClientGone):
            await self._send({"type": "websocket.close", "code": code, "reason": reason[:120]})
        self.closed = True

    async def fail(self, exc: LiveError) -> None:
        """The error event, then the close; nothing when the socket is already gone."""
        with contextlib.suppress(_ClientGone):
            await self.event({"type": "error", **error_body(exc.status, exc.message, code=exc.code, param=exc.param)})
        await self.close(exc.close_code, exc.code)
