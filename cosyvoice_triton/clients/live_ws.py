"""Live sessions over the gateway's WebSocket (docs/live.md, "Over WebSocket"): what a client of
``/v1/audio/voice-conversion/live`` and ``/v1/audio/speech/live`` needs to speak the protocol, and
:class:`LiveSocket`, the same sessions as :class:`~.live.LiveClient` runs over Triton's gRPC, through the door.

:class:`LiveSocket` (sync; a thread sends while the caller reads) yields :class:`~.live.LiveChunk` objects and fills
:class:`~.live.LiveStats` exactly as the gRPC client does, so the two are measured alike: it asks for the
``events`` stream format, whose ``speech.audio.delta`` names the ``piece`` (the index of the input message whose
arrival let the chunk be computed), and a chunk's latency is its arrival after that message was sent. The
``session.started`` answer is awaited before the first piece, so a piece's clock starts on an open session.
"""

from __future__ import annotations

import base64
import contextlib
import json
import math
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from .live import LiveChunk, LiveStats
from .wire import VCError

__all__ = ["SAMPLE_RATE", "LiveSocket", "LiveSpeechError", "SessionReader", "auth_headers", "session_start"]

#: The rate of the audio a live session gives (the models' 24 kHz).
SAMPLE_RATE = 24000
VC_PATH, TTS_PATH = "/v1/audio/voice-conversion/live", "/v1/audio/speech/live"


class LiveSpeechError(VCError):
    """The gateway ended the session with an ``error`` event: ``code`` is its code (``invalid_api_key``,
    ``capacity``, ``invalid_input``, ...: docs/live.md, "Errors"), ``param`` the field it names; ``closed``: the
    socket closed (``close_code``) before ``speech.audio.done``."""

    def __init__(self, code: str, message: str, param: str | None = None, close_code: int | None = None):
        super().__init__(message, code)
        self.code, self.param, self.close_code = code, param, close_code


def session_start(voice, reference_audio, reference_text, seed, output_format, stream_format, **fields) -> str:
    """The ``session.start`` message (``reference_audio`` bytes are sent as base64; ``fields``: ``sample_rate``,
    ``sample_format`` of a VC session)."""
    body: dict[str, Any] = {"type": "session.start", "output_format": output_format, "stream_format": stream_format}
    for name, value in (("voice", voice), ("reference_audio", reference_audio), ("reference_text", reference_text),
                        ("seed", seed), *fields.items()):
        if value is not None:
            body[name] = base64.b64encode(value).decode() if isinstance(value, (bytes, bytearray)) else value
    return json.dumps(body)


def auth_headers(key: str | None) -> dict[str, str] | None:
    return {"Authorization": f"Bearer {key}"} if key else None


class SessionReader:
    """The session's messages from the gateway: :meth:`take` one; the audio it carries (None: none), and in
    ``piece`` the input message an event's audio answers (None: not named). The sender starts once ``started``
    is set."""

    def __init__(self):
        self.started: dict | None = None  # session.started's "session"
        self.done: dict | None = None  # speech.audio.done
        self.piece: int | None = None

    def take(self, message: str | bytes) -> bytes | None:
        self.piece = None
        if isinstance(message, (bytes, bytearray)):
            return bytes(message)
        event = json.loads(message)
        kind = event.get("type")
        if kind == "error":
            err = event.get("error") or {}
            raise LiveSpeechError(str(err.get("code")), str(err.get("message")), err.get("param"))
        if kind == "session.started":
            self.started = event.get("session") or {}
        elif kind == "speech.audio.delta":
            piece = event.get("piece")
            self.piece = piece if isinstance(piece, int) else None
            return base64.b64decode(event["audio"])
        elif kind == "speech.audio.done":
            self.done = event
        return None

    @property
    def most(self) -> int:
        return int((self.started or {}).get("max_piece_chars") or 4096)

    def finish(self, close_code: int | None, failed: BaseException | None) -> None:
        """The socket closed: raise what ended the sender, or a close before the end."""
        if failed is not None:
            raise failed
        if self.done is None:
            raise LiveSpeechError("closed", f"the gateway closed the session ({close_code}) before speech.audio.done",
                                  close_code=close_code)


class LiveSocket:
    """Live sessions through the gateway at ``url`` (``http://host:8080`` or ``ws://host:8080``) with ``key``;
    ``timeout``: the socket's open and close waits, s; ``connect_options`` go to ``websockets.sync.client.connect``
    (``proxy``, ``ssl``, ...). Each call is one session, its socket closed when the iteration ends (or is left)."""

    def __init__(self, url: str, *, key: str | None = None, timeout: float = 60.0, **connect_options):
        base = url.rstrip("/")
        for plain, secure in (("http://", "ws://"), ("https://", "wss://")):
            if base.startswith(plain):
                base = secure + base[len(plain):]
        self.base = base if base.startswith(("ws://", "wss://")) else "ws://" + base
        self.key, self.timeout, self.options = key, timeout, connect_options

    def convert_live(self, pieces: Iterable[np.ndarray], *, sample_rate: int, voice: str | None = None,
                     reference_audio: bytes | None = None, seed: int | None = None,
                     stats: LiveStats | None = None) -> Iterator[LiveChunk]:
        """Convert ``pieces`` (float samples at ``sample_rate``, sent as ``f32le`` frames as the iterable gives
        them) in ``voice`` or the voice of ``reference_audio`` (an encoded recording)."""
        start = session_start(voice, reference_audio, None, seed, "f32le", "events", sample_rate=int(sample_rate),
                              sample_format="f32le")

        def frames():
            for piece in pieces:
                samples = np.ascontiguousarray(np.asarray(piece, np.float32).reshape(-1))
                yield samples.astype("<f4").tobytes(), len(samples) / sample_rate

        return self._session(VC_PATH, start, frames(), stats)

    def tts_live(self, texts: Iterable[str], *, voice: str | None = None, reference_audio: bytes | None = None,
                 reference_text: str | None = None, seed: int | None = None,
                 stats: LiveStats | None = None) -> Iterator[LiveChunk]:
        """Speak ``texts`` (text deltas, each an ``input.text`` message as the iterable gives it)."""
        start = session_start(voice, reference_audio, reference_text, seed, "f32le", "events")
        return self._session(TTS_PATH, start, ((json.dumps({"type": "input.text", "text": t}), 0.0)
                                               for t in texts), stats)

    def _session(self, path: str, start: str, messages: Iterator[tuple[str | bytes, float]],
                 stats: LiveStats | None) -> Iterator[LiveChunk]:
        from websockets.exceptions import ConnectionClosed
        from websockets.sync.client import connect

        stats = stats if stats is not None else LiveStats()
        reader, sent_at, failed = SessionReader(), [], []
        clock: dict[str, float] = {}

        def send(ws) -> None:
            try:
                for message, seconds in messages:
                    now = time.perf_counter()
                    clock.setdefault("t0", now)
                    sent_at.append(now)
                    ws.send(message)
                    stats.pieces += 1
                    stats.source_seconds += seconds
                sent_at.append(time.perf_counter())
                ws.send(json.dumps({"type": "input.end"}))
            except ConnectionClosed:
                return  # the reader sees the close
            except Exception as exc:  # the pieces failed: the reader raises it
                failed.append(exc)
                with contextlib.suppress(Exception):
                    ws.close(1011, "the input failed")

        with connect(self.base + path, additional_headers=auth_headers(self.key), open_timeout=self.timeout,
                     close_timeout=self.timeout, **{"max_size": None, **self.options}) as ws:
            sender = None
            with contextlib.suppress(ConnectionClosed):  # a refusal (its event read below) may come first
                ws.send(start)
            try:
                with contextlib.suppress(ConnectionClosed):
                    for message in ws:
                        data = reader.take(message)
                        if reader.started is not None and sender is None:
                            sender = threading.Thread(target=send, args=(ws,), name="live-ws-send", daemon=True)
                            sender.start()
                        if not data:
                            continue
                        arrival = time.perf_counter()
                        piece = reader.piece
                        latency = arrival - sent_at[piece] if piece is not None and piece < len(sent_at) else math.nan
                        chunk = LiveChunk(np.frombuffer(data, "<f4").copy(), SAMPLE_RATE, stats.chunks,
                                          arrival - clock.get("t0", arrival), piece=-1 if piece is None else piece,
                                          latency_s=latency)
                        stats.add(chunk, arrival)
                        yield chunk
                reader.finish(ws.close_code, failed[0] if failed else None)
            finally:
                if sender is not None and sender.is_alive():
                    ws.close()
                    sender.join(self.timeout)
