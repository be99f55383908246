"""Live sessions over one gRPC stream, sync and asyncio: voice conversion of audio as it is recorded
(``cosyvoice_vc_live``) and text to speech of text as it is written (``cosyvoice_tts_live``).

    with LiveClient("127.0.0.1:8001") as client:
        stats = LiveStats()
        pieces = PacedPieces("talk.wav", piece_ms=200)            # a file at real-time pace, in 200 ms pieces
        for chunk in client.convert_live(pieces, prompt="voice.wav", stats=stats):
            play(chunk.waveform)                                   # converted audio as it arrives
        print(stats.summary())

        for chunk in client.tts_live(llm_words(), speaker_id="alice"):   # text pieces as an LLM writes them
            play(chunk.waveform)

    async with AsyncLiveClient("127.0.0.1:8001") as client:
        async for chunk in client.convert_live(microphone(), speaker_id="alice", sample_rate=16000): ...

One session is one Triton sequence on one gRPC stream: a random sequence id (below 2**63: tritonclient's gRPC
request carries it as int64), each piece one request (the first with ``sequence_start`` and the voice: prompt audio,
an encoded prompt file, or a registered ``speaker_id``, and the seed), and when the pieces run out one more request
with no audio (empty text) and ``sequence_end``. Pieces are sent as they come, while the chunks they cause arrive;
empty pieces are skipped. At most ``max_in_flight`` requests wait for their answer at once (below the server's
per-session queue, so its back-pressure refusal never comes: a server that falls behind holds the pieces back here).
The session ends when every request has its final response. A refusal raises :class:`~.client.VCError` with the
server's message and the code its message starts with (``status`` ``StatusCode.INVALID_ARGUMENT`` for bad input,
``StatusCode.UNAVAILABLE`` at capacity: a live session is never sent again); the end of the sequence still goes,
so the server frees the session at once. Closing the iteration early sends the end of the sequence, waits
``close_wait_s`` for the answers, then cancels what is left.

Timing (:class:`LiveStats`): each chunk is charged to the piece whose arrival let the server compute it (VC: the
piece that brought the source sent to the chunk's ``source_seconds``; TTS: piece ``text_pieces``); its latency is
its arrival minus that piece's send time. The real-time margin comes from a play-out model: playback starts when
the first chunk arrives (plus ``buffer_s``) and plays every chunk back to back; a chunk's margin is how long before
its audio is needed it arrived, a negative one is an underrun (the player stalls until it arrives).
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import math
import queue
import secrets
import threading
import time
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import AudioError
from ..frontend import audio
from .async_client import AsyncCosyVoiceClient
from .sync_client import CosyVoiceClient
from .wire import (
    StreamChunk,
    VCError,
    _audio_inputs,
    _is_final,
    _payload,
    _tensor,
    _text,
    load_input,
)

__all__ = ["TTS_LIVE_MODEL", "VC_LIVE_MODEL", "AsyncLiveClient", "LiveChunk", "LiveClient", "LiveStats",
           "PacedPieces", "live_error", "new_sequence_id", "pcm_pieces", "session_model", "text_pieces"]

VC_LIVE_MODEL = "cosyvoice_vc_live"
TTS_LIVE_MODEL = "cosyvoice_tts_live"
#: the served live models of each kind (both families)
_LIVE_MODELS = {"vc": (VC_LIVE_MODEL, "cosyvoice3_vc_live"), "tts": (TTS_LIVE_MODEL, "cosyvoice3_tts_live")}


def session_model(kind: str, given: str | None, own: str | None) -> str:
    """The model a ``kind`` (``vc`` / ``tts``) session runs on: ``given``; else the client's own model (its
    constructor's ``model``), unless that names the other kind's live model (a client made with the default, VC,
    that speaks); else the kind's default."""
    if given is not None:
        return given
    other = _LIVE_MODELS["tts" if kind == "vc" else "vc"]
    if not own or own in other:
        return _LIVE_MODELS[kind][0]
    return own


def new_sequence_id() -> int:
    """A random, non-zero sequence (correlation) id below 2**63."""
    return secrets.randbits(63) or 1


# ---------------------------------------------------------------------------------------------- pieces


class PacedPieces:
    """A recording cut into pieces of ``piece_ms``, each given out once it "has been recorded": piece ``k`` at
    ``(k + 1) * piece_ms`` after the iteration starts (``realtime=False``: at once). A path or encoded bytes
    (decoded here), or samples with their ``sample_rate``; iterate it (``for``) or ``async for`` it."""

    def __init__(self, source, *, sample_rate: int | None = None, piece_ms: float = 200.0, realtime: bool = True):
        if not piece_ms > 0:
            raise ValueError(f"piece_ms must be > 0, got {piece_ms}")
        self.samples, self.sample_rate = load_input(source, sample_rate, name="source")
        self.piece = max(1, round(self.sample_rate * piece_ms / 1000.0))
        self.realtime = bool(realtime)

    @property
    def seconds(self) -> float:
        return len(self.samples) / self.sample_rate

    def _pieces(self) -> Iterator[tuple[float, np.ndarray]]:
        for start in range(0, len(self.samples), self.piece):
            piece = self.samples[start : start + self.piece]
            yield (start + len(piece)) / self.sample_rate, piece

    def __iter__(self) -> Iterator[np.ndarray]:
        t0 = time.perf_counter()
        for due, piece in self._pieces():
            if self.realtime:
                time.sleep(max(0.0, t0 + due - time.perf_counter()))
            yield piece

    async def __aiter__(self) -> AsyncIterator[np.ndarray]:
        t0 = time.perf_counter()
        for due, piece in self._pieces():
            if self.realtime:
                await asyncio.sleep(max(0.0, t0 + due - time.perf_counter()))
            yield piece


def pcm_pieces(stream, *, sample_rate: int, piece_ms: float = 200.0) -> Iterator[np.ndarray]:
    """Raw 16-bit little-endian mono PCM from a binary stream (``sys.stdin.buffer``: ``arecord -f S16_LE``) in pieces
    of ``piece_ms`` (int16 arrays), each as soon as it has been read; the last one may be shorter."""
    size = 2 * max(1, round(sample_rate * piece_ms / 1000.0))
    carry = b""
    while data := stream.read(size - len(carry)):
        data, carry = carry + data, b""
        if len(data) % 2:  # a short read that split a sample: its first byte waits for the next read
            data, carry = data[:-1], data[-1:]
        if data:
            yield np.frombuffer(data, "<i2")


def text_pieces(lines: Iterable[str], *, chunk_chars: int = 0) -> Iterator[str]:
    """Text pieces from lines as they arrive (``sys.stdin``): each line (its line break as a space), or with
    ``chunk_chars`` cut into pieces of that many characters, as an LLM's tokens would come."""
    for line in lines:
        text = line.rstrip("\r\n") + " " if line.endswith("\n") else line
        if not text:
            continue
        if chunk_chars <= 0:
            yield text
            continue
        for start in range(0, len(text), chunk_chars):
            yield text[start : start + chunk_chars]


# ------------------------------------------------------------------------------------------------ timing


@dataclass
class LiveChunk(StreamChunk):
    """A streamed chunk of a live session: ``piece`` is the piece it is charged to (see the module docstring),
    ``latency_s`` its arrival after that piece was sent, ``margin_s`` its play-out margin (None for the first);
    ``source_seconds`` (VC) / ``text_pieces`` (TTS) as the server sent them."""

    piece: int = -1
    latency_s: float = math.nan
    margin_s: float | None = None
    source_seconds: float | None = None
    text_pieces: int | None = None

    @property
    def seconds(self) -> float:
        return len(self.waveform) / max(self.sample_rate, 1)


@dataclass
class LiveStats:
    """Filled in while a live session runs: pieces sent, chunks received, per-chunk latency, the play-out margin
    (``buffer_s``: how long after the first chunk playback starts), underruns."""

    buffer_s: float = 0.0
    pieces: int = 0
    source_seconds: float = 0.0  # VC: seconds of source audio sent
    chunks: int = 0
    samples: int = 0
    sample_rate: int = 0
    first_audio_s: float | None = None  # first piece sent -> first chunk
    total_s: float = 0.0  # first piece sent -> the last chunk
    latencies_s: list[float] = field(default_factory=list)
    margin_s: float | None = None  # the smallest chunk margin (negative: at least one underrun)
    underruns: int = 0
    stall_s: float = 0.0  # playback time lost waiting for late chunks
    needed_buffer_s: float = 0.0  # the smallest buffer_s with no underrun in this session
    _play_end: float | None = field(default=None, repr=False)
    _played: tuple[float, float] | None = field(default=None, repr=False)  # first arrival, audio seconds before

    def add(self, chunk: LiveChunk, arrival: float) -> None:
        """Count ``chunk``, which arrived at ``arrival`` (``time.perf_counter``), and set its margin."""
        if self.first_audio_s is None:
            self.first_audio_s = chunk.elapsed_s
        self.total_s = chunk.elapsed_s
        self.chunks += 1
        self.samples += len(chunk.waveform)
        self.sample_rate = chunk.sample_rate
        if not math.isnan(chunk.latency_s):
            self.latencies_s.append(chunk.latency_s)
        if not len(chunk.waveform):
            return
        first, before = self._played or (arrival, 0.0)
        self.needed_buffer_s = max(self.needed_buffer_s, arrival - first - before)
        self._played = (first, before + chunk.seconds)
        if self._play_end is None:
            self._play_end = arrival + self.buffer_s + chunk.seconds
            return
        slack = self._play_end - arrival
        chunk.margin_s = slack
        self.margin_s = slack if self.margin_s is None else min(self.margin_s, slack)
        if slack < 0:
            self.underruns += 1
            self.stall_s -= slack
            self._play_end = arrival + chunk.seconds
        else:
            self._play_end += chunk.seconds

    @property
    def audio_seconds(self) -> float:
        return self.samples / max(self.sample_rate, 1)

    @property
    def rtf(self) -> float:
        """Seconds from the first piece to the last chunk per second of audio (below 1 only when the pieces were
        sent faster than real time)."""
        return self.total_s / max(self.audio_seconds, 1e-9)

    def latency_ms(self, q: float) -> float:
        """The ``q``-th percentile (0-100) of the chunk latencies, ms (NaN: none yet)."""
        return float(np.percentile(self.latencies_s, q) * 1000.0) if self.latencies_s else math.nan

    def summary(self) -> str:
        first = f"{self.first_audio_s * 1000:.0f} ms" if self.first_audio_s is not None else "never"
        margin = f"{self.margin_s * 1000:+.0f} ms" if self.margin_s is not None else "n/a"
        source = f" ({self.source_seconds:.2f} s of source)" if self.source_seconds else ""
        return (f"{self.pieces} pieces{source}, {self.chunks} chunks ({self.audio_seconds:.2f} s of audio at "
                f"{self.sample_rate} Hz); first audio after {first}; latency p50 {self.latency_ms(50):.0f} ms, "
                f"p95 {self.latency_ms(95):.0f} ms; real-time margin {margin} ({self.underruns} underruns, "
                f"{self.stall_s:.2f} s stalled; gap-free from a {self.needed_buffer_s * 1000:.0f} ms buffer); "
                f"{self.total_s:.2f} s in all")


# ---------------------------------------------------------------------------------------------- framing


class _Session:
    """One live session's requests and the bookkeeping of its answers (the same for the sync and asyncio
    clients): :meth:`request` frames a piece, :meth:`end` the end of the sequence, :meth:`receive` an answer."""

    def __init__(self, module, model: str, kind: str, voice: list, *, sample_rate: int | None = None,
                 stats: LiveStats | None = None, priority: int = 0, sequence_id: int | str | None = None):
        self.module, self.model, self.kind, self.voice = module, model, kind, voice
        self.sample_rate = sample_rate
        self.stats = stats if stats is not None else LiveStats()
        self.priority = priority
        self.sequence_id = new_sequence_id() if sequence_id is None else sequence_id
        self.channels = audio.StreamChannels()  # VC: the pieces' layout, fixed by the first one
        self.sent_at: list[float] = []  # perf_counter of each request
        self.ends: list[float] = []  # VC: source seconds sent after each request
        self.finals = self.errors = 0  # each request gets one of the two
        self.ended = False  # the end of the sequence has been sent
        self.t0: float | None = None
        self.last_event = time.perf_counter()

    @property
    def outstanding(self) -> int:
        return len(self.sent_at) - self.finals

    @property
    def done(self) -> bool:
        return self.ended and self.finals >= len(self.sent_at)

    @property
    def settled(self) -> bool:
        """Every request sent, the end included, has been answered (a final response or an error)."""
        return self.ended and self.finals + self.errors >= len(self.sent_at)

    def refusal(self, error) -> VCError:
        """Account for an error answer; the :class:`VCError` to raise."""
        self.errors += 1
        self.last_event = time.perf_counter()
        return live_error(error)

    def _source(self, samples: np.ndarray) -> list:
        return [_tensor(self.module, "source_audio", np.ascontiguousarray(samples, np.float32)[None], "FP32"),
                _tensor(self.module, "source_sample_rate", np.array([[self.sample_rate]], np.int32), "INT32")]

    def _frame(self, inputs: list, seconds: float, last: bool) -> dict[str, Any]:
        k = len(self.sent_at)
        if k == 0:
            inputs = inputs + self.voice
        now = time.perf_counter()
        self.t0 = now if self.t0 is None else self.t0
        self.sent_at.append(now)
        self.ends.append((self.ends[-1] if self.ends else 0.0) + seconds)
        self.last_event = now
        self.stats.pieces += not last
        self.stats.source_seconds = self.ends[-1]
        self.ended = last
        return {"model_name": self.model, "inputs": inputs, "request_id": str(k), "sequence_id": self.sequence_id,
                "sequence_start": k == 0, "sequence_end": last, "priority": self.priority}

    def request(self, piece) -> dict[str, Any] | None:
        """The request of one piece (None: an empty piece, not sent)."""
        k = len(self.sent_at)
        if self.kind == "vc":
            samples = self.channels.mono(piece, name=f"source piece {k}")
            return self._frame(self._source(samples), len(samples) / self.sample_rate, False) if samples.size else None
        if not isinstance(piece, (str, bytes, bytearray)):
            raise AudioError(f"text piece {k}: str or bytes, got {type(piece).__name__}")
        return self._frame([_text(self.module, "text", piece)], 0.0, False) if piece else None

    def end(self) -> dict[str, Any]:
        """The end of the sequence: no audio / empty text."""
        inputs = self._source(np.zeros(0, np.float32)) if self.kind == "vc" else [_text(self.module, "text", b"")]
        return self._frame(inputs, 0.0, True)

    def _piece_of(self, result, rid: str) -> int:
        n = len(self.sent_at)
        if self.kind == "vc":
            seconds = _scalar(result, "source_seconds")
            if seconds is not None:  # float32: within half a sample, or its own rounding on a long session
                tolerance = 0.5 / max(self.sample_rate or 1, 1) + abs(float(seconds)) * 1.2e-7
                return min(bisect.bisect_left(self.ends, float(seconds) - tolerance), n - 1)
        else:
            count = _scalar(result, "text_pieces")
            if count is not None:
                return min(max(int(count) - 1, 0), n - 1)
        return int(rid) if rid.isdigit() and int(rid) < n else n - 1

    def check_silence(self, timeout: float) -> None:
        """Raise when requests wait for an answer and nothing came for ``timeout`` seconds."""
        if self.outstanding and time.perf_counter() - self.last_event > timeout:
            raise VCError(f"{self.model}: no answer within {timeout:g} s", "timeout")

    def take(self, result, error) -> LiveChunk | None:
        """One item of the stream's inbox: the pieces' failure or the server's refusal raised, else
        :meth:`receive`."""
        if isinstance(error, _PiecesFailed):
            raise error.exc
        if error is not None:
            raise self.refusal(error)
        return self.receive(result)

    def receive(self, result) -> LiveChunk | None:
        """Account for one answer; the chunk it carries, if any."""
        arrival = time.perf_counter()
        self.last_event = arrival
        response = result.get_response()
        final = _is_final(result)
        chunk = None
        wave = result.as_numpy("waveform")
        if wave is not None:
            sr = _scalar(result, "sample_rate")
            if sr is None:
                raise VCError(f"{self.model}: a chunk without a sample_rate output")
            piece = self._piece_of(result, response.id)
            index = _scalar(result, "chunk_index")
            seconds = _scalar(result, "source_seconds")
            count = _scalar(result, "text_pieces")
            chunk = LiveChunk(np.asarray(wave, np.float32).reshape(-1), int(sr),
                              self.stats.chunks if index is None else int(index), arrival - (self.t0 or arrival),
                              piece=piece, latency_s=arrival - self.sent_at[piece],
                              source_seconds=None if seconds is None else float(seconds),
                              text_pieces=None if count is None else int(count))
            self.stats.add(chunk, arrival)
        if final:
            self.finals += 1
        return chunk


#: The codes a live model's error message starts with (``"UNAVAILABLE: ..."``): a gRPC stream carries no code.
_CODES = ("INVALID_ARGUMENT", "UNAVAILABLE", "CANCELLED", "INTERNAL")


def live_error(error) -> VCError:
    """A live session's error answer as :class:`VCError`, its status read from the code the message starts with;
    Triton's refusal of a piece of a sequence it does not know counts as ``INVALID_ARGUMENT``."""
    exc = VCError.from_exception(error)
    if exc.status is not None:
        return exc
    code, sep, rest = exc.message.partition(": ")
    if sep and code in _CODES:
        return VCError(rest, f"StatusCode.{code}")
    if "must specify the START flag" in exc.message:
        return VCError(exc.message, "StatusCode.INVALID_ARGUMENT")
    return exc


def _scalar(result, name: str):
    arr = result.as_numpy(name)
    return None if arr is None or not arr.size else np.asarray(arr).reshape(-1)[0]


class _PiecesFailed(Exception):
    """What the pieces' iterable raised, carried to the consumer."""

    def __init__(self, exc: BaseException):
        super().__init__(str(exc))
        self.exc = exc


def _vc_voice(module, prompt, prompt_sr, speaker_id, seed, encoded) -> list:
    if (prompt is None) == (speaker_id is None):
        raise AudioError("prompt: give the prompt audio or a registered speaker_id (one of them)")
    voice = []
    if prompt is not None:
        data, sr = _payload(prompt, prompt_sr, "prompt", encoded)
        voice += _audio_inputs(module, "prompt", data, sr)
    else:
        voice.append(_text(module, "speaker_id", speaker_id))
    if seed is not None:
        voice.append(_tensor(module, "seed", np.array([[int(seed)]], np.int64), "INT64"))
    return voice


def _tts_voice(module, prompt, prompt_sr, prompt_text, speaker_id, seed, encoded) -> list:
    voice = _vc_voice(module, prompt, prompt_sr, speaker_id, seed, encoded)
    if prompt_text is not None:
        voice.append(_text(module, "prompt_text", prompt_text))
    return voice


def _rate(pieces, sample_rate) -> int:
    rate = sample_rate if sample_rate is not None else getattr(pieces, "sample_rate", None)
    if rate is None:
        raise AudioError("source: give the pieces' sample_rate")
    if int(rate) <= 0:
        raise AudioError(f"source: sample_rate must be > 0, got {rate}")
    return int(rate)


# ------------------------------------------------------------------------------------------------ sync


class LiveClient(CosyVoiceClient):
    """:class:`~.sync_client.CosyVoiceClient` (gRPC) with live sessions: :meth:`convert_live`, :meth:`tts_live`.
    One session at a time per client (one gRPC stream); a client per session for several at once."""

    close_wait_s = 5.0  # closing early: how long the end of the sequence may take to be answered
    max_in_flight = 4  # requests waiting for their answers at once (the server keeps 8 waiting per session)

    def __init__(self, url: str | None = None, *, protocol: str = "grpc", model: str = VC_LIVE_MODEL, **kw):
        if protocol != "grpc":
            raise ValueError("live sessions run over a gRPC stream: protocol='grpc'")
        super().__init__(url, protocol=protocol, model=model, **kw)

    def convert_live(self, pieces: Iterable, *, prompt=None, speaker_id: str | None = None,
                     sample_rate: int | None = None, prompt_sr: int | None = None, seed: int | None = None,
                     encoded: bool = False, stats: LiveStats | None = None, model: str | None = None,
                     priority: int | None = None) -> Iterator[LiveChunk]:
        """Convert source pieces (sample arrays at ``sample_rate``, or a :class:`PacedPieces`, which carries its
        rate) into the voice of ``prompt`` (path, bytes, or samples with ``prompt_sr``; ``encoded``: a file sent
        as it is) or of a registered ``speaker_id``, over one live session: chunks as they arrive. A piece is
        ``[N]`` mono or ``[N, C]`` frames, C fixed by the first piece (:class:`~..frontend.audio.StreamChannels`).
        ``model``: the live model (default: :func:`session_model`: the client's own unless that is a TTS one)."""
        voice = _vc_voice(self._module, prompt, prompt_sr, speaker_id, seed, encoded)
        model = session_model("vc", model, self.model)
        session = _Session(self._module, model, "vc", voice, sample_rate=_rate(pieces, sample_rate), stats=stats,
                           priority=self.validate_priority(model, priority))
        return self._run(session, pieces)

    def tts_live(self, text_pieces: Iterable[str | bytes], *, prompt=None, prompt_sr: int | None = None,
                 prompt_text: str | None = None, speaker_id: str | None = None, seed: int | None = None,
                 encoded: bool = False, stats: LiveStats | None = None, model: str | None = None,
                 priority: int | None = None) -> Iterator[LiveChunk]:
        """Speak text pieces (str, or UTF-8 bytes that may split a character) as they come, in the voice of
        ``prompt`` (+ its ``prompt_text``) or a registered ``speaker_id``: chunks as they arrive. ``model``: the
        live model (default: :func:`session_model`: the client's own unless that is a VC one)."""
        voice = _tts_voice(self._module, prompt, prompt_sr, prompt_text, speaker_id, seed, encoded)
        model = session_model("tts", model, self.model)
        session = _Session(self._module, model, "tts", voice, stats=stats,
                           priority=self.validate_priority(model, priority))
        return self._run(session, text_pieces)

    def _run(self, session: _Session, pieces: Iterable) -> Iterator[LiveChunk]:
        inbox: queue.Queue = queue.Queue()  # (result, error) from the stream's thread and the feeder
        lock, closed = threading.Condition(), threading.Event()  # lock: sending; notified as answers come
        client, window = self._client, max(1, int(self.max_in_flight))

        def room() -> bool:  # called with the lock held
            while session.outstanding >= window and not closed.is_set():
                lock.wait(0.25)
            return not closed.is_set()

        def send(request: dict[str, Any]) -> None:
            request = dict(request)
            try:
                client.async_stream_infer(request.pop("model_name"), request.pop("inputs"),
                                          enable_empty_final_response=True, **request)
            except Exception as exc:
                raise VCError.from_exception(exc) from exc

        def feed() -> None:
            try:
                for piece in pieces:
                    with lock:
                        if not room():
                            return
                        request = session.request(piece)
                        if request is not None:
                            send(request)
                with lock:
                    if room():
                        send(session.end())
            except BaseException as exc:  # the consumer raises it and ends the session
                inbox.put((None, _PiecesFailed(exc)))

        try:
            client.start_stream(callback=lambda result, error: inbox.put((result, error)))
        except Exception as exc:
            raise VCError.from_exception(exc) from exc
        threading.Thread(target=feed, name=f"live-{session.sequence_id}", daemon=True).start()
        try:
            while not session.done:
                try:
                    result, error = inbox.get(timeout=0.25)
                except queue.Empty:
                    session.check_silence(self.timeout)
                    continue
                chunk = session.take(result, error)
                with lock:
                    lock.notify_all()
                if chunk is not None:
                    yield chunk
        finally:  # done, failed or closed early: the end of the sequence goes (once), then a short wait for it
            with lock:
                closed.set()
                lock.notify_all()
                if not session.ended:
                    with contextlib.suppress(Exception):
                        send(session.end())
            deadline = time.perf_counter() + self.close_wait_s
            while not session.settled and time.perf_counter() < deadline:
                try:
                    result, error = inbox.get(timeout=0.05)
                except queue.Empty:
                    continue
                if isinstance(error, _PiecesFailed):
                    continue
                if error is not None:
                    session.refusal(error)
                    continue
                with contextlib.suppress(Exception):
                    session.receive(result)
            client.stop_stream(cancel_requests=not session.done)


# ---------------------------------------------------------------------------------------------- asyncio


async def _aiter(pieces) -> AsyncIterator:
    if isinstance(pieces, AsyncIterable):
        async for piece in pieces:
            yield piece
    else:
        for piece in pieces:
            yield piece


class AsyncLiveClient(AsyncCosyVoiceClient):
    """:class:`~.async_client.AsyncCosyVoiceClient` (gRPC) with live sessions (``async for``): see
    :class:`LiveClient`. The pieces: an async iterable, or a plain one that does not block (a list)."""

    close_wait_s = LiveClient.close_wait_s
    max_in_flight = LiveClient.max_in_flight

    def __init__(self, url: str | None = None, *, protocol: str = "grpc", model: str = VC_LIVE_MODEL, **kw):
        if protocol != "grpc":
            raise ValueError("live sessions run over a gRPC stream: protocol='grpc'")
        super().__init__(url, protocol=protocol, model=model, **kw)

    async def convert_live(self, pieces, *, prompt=None, speaker_id: str | None = None,
                           sample_rate: int | None = None, prompt_sr: int | None = None, seed: int | None = None,
                           encoded: bool = False, stats: LiveStats | None = None, model: str | None = None,
                           priority: int | None = None, sequence_id: int | str | None = None
                           ) -> AsyncIterator[LiveChunk]:
        """See :meth:`LiveClient.convert_live`; ``sequence_id``: the session's id (default: a random one)."""
        voice = _vc_voice(self._module, prompt, prompt_sr, speaker_id, seed, encoded)
        model = session_model("vc", model, self.model)
        session = _Session(self._module, model, "vc", voice, sample_rate=_rate(pieces, sample_rate), stats=stats,
                           priority=await self.validate_priority(model, priority), sequence_id=sequence_id)
        async with contextlib.aclosing(self._run(session, pieces)) as chunks:  # closed now, not when collected
            async for chunk in chunks:
                yield chunk

    async def tts_live(self, text_pieces, *, prompt=None, prompt_sr: int | None = None,
                       prompt_text: str | None = None, speaker_id: str | None = None, seed: int | None = None,
                       encoded: bool = False, stats: LiveStats | None = None, model: str | None = None,
                       priority: int | None = None, sequence_id: int | str | None = None
                       ) -> AsyncIterator[LiveChunk]:
        """See :meth:`LiveClient.tts_live`; ``sequence_id`` as for :meth:`convert_live`."""
        voice = _tts_voice(self._module, prompt, prompt_sr, prompt_text, speaker_id, seed, encoded)
        model = session_model("tts", model, self.model)
        session = _Session(self._module, model, "tts", voice, stats=stats,
                           priority=await self.validate_priority(model, priority), sequence_id=sequence_id)
        async with contextlib.aclosing(self._run(session, text_pieces)) as chunks:
            async for chunk in chunks:
                yield chunk

    async def _run(self, session: _Session, pieces) -> AsyncIterator[LiveChunk]:
        outbox: asyncio.Queue = asyncio.Queue()  # the stream's requests; None closes it
        inbox: asyncio.Queue = asyncio.Queue()  # (result, error) from the reader and the feeder
        final = {"triton_enable_empty_final_response": True}  # tritonclient.grpc.aio has no argument for it
        answered = asyncio.Condition()  # notified as answers come
        window = max(1, int(self.max_in_flight))

        async def room() -> None:
            async with answered:
                await answered.wait_for(lambda: session.outstanding < window)

        async def feed() -> None:
            try:
                async for piece in _aiter(pieces):
                    await room()
                    request = session.request(piece)
                    if request is not None:
                        outbox.put_nowait({**request, "parameters": final})
                await room()
                outbox.put_nowait({**session.end(), "parameters": final})
            except asyncio.CancelledError:
                raise
            except BaseException as exc:  # the consumer raises it and ends the session
                inbox.put_nowait((None, _PiecesFailed(exc)))

        async def requests():
            while (request := await outbox.get()) is not None:
                yield request
                if request["sequence_end"]:
                    return

        call = self._client.stream_infer(requests())

        async def read() -> None:
            try:
                async for item in call:
                    inbox.put_nowait(item)
            except Exception as exc:  # the stream broke: the consumer raises it
                inbox.put_nowait((None, exc))

        feeder, reader = asyncio.create_task(feed()), asyncio.create_task(read())
        try:
            while not session.done:
                try:
                    result, error = await asyncio.wait_for(inbox.get(), timeout=0.25)
                except asyncio.TimeoutError:
                    session.check_silence(self.timeout)
                    continue
                chunk = session.take(result, error)
                async with answered:
                    answered.notify_all()
                if chunk is not None:
                    yield chunk
        finally:  # as LiveClient._run: the end of the sequence (once), a short wait for it, then cancel the rest
            feeder.cancel()
            with contextlib.suppress(BaseException):
                await feeder
            if not session.ended:
                outbox.put_nowait({**session.end(), "parameters": final})
            deadline = time.perf_counter() + self.close_wait_s
            while not session.settled and time.perf_counter() < deadline:
                try:
                    result, error = await asyncio.wait_for(inbox.get(), timeout=0.05)
                except asyncio.TimeoutError:
                    continue
                if isinstance(error, _PiecesFailed):
                    continue
                if error is not None:
                    session.refusal(error)
                    continue
                with contextlib.suppress(Exception):
                    session.receive(result)
            outbox.put_nowait(None)
            if not session.done:
                call.cancel()
            reader.cancel()
            with contextlib.suppress(BaseException):
                await reader
