"""Speak an LLM's answer as it is generated: an OpenAI-compatible chat completion stream in, live speech out.

The text of a stream (:func:`text_deltas`, :func:`atext_deltas`): the ``openai`` SDK's
``client.chat.completions.create(..., stream=True)`` (its ``ChatCompletionChunk`` objects, sync or async), the
raw server-sent events' JSON as dicts, or plain strings. Each chunk gives ``choices[i].delta.content`` of the
choice whose ``index`` is ``choice`` (0); role-only, tool-call, usage-only and empty chunks give nothing. Nothing
from the ``openai`` package is imported: the chunks are read by their fields.

Over the gateway's WebSocket (``/v1/audio/speech/live``, docs/live.md "Over WebSocket"), :func:`speak` (sync, a
thread sends) and :func:`aspeak` (asyncio, a task sends) open one session: ``session.start`` with the voice, then
each delta as an ``input.text`` message as the LLM writes it while the audio is read back, ``input.end`` when the
LLM's stream ends; they yield the audio as it comes, raw mono samples at :data:`SAMPLE_RATE` in the session's
``output_format`` (``s16le``: 16-bit, OpenAI's ``pcm``; ``f32le``), from binary frames or ``speech.audio.delta``
events alike. The gateway's ``error`` event raises :class:`LiveSpeechError` naming its ``code``; a close without
``speech.audio.done`` raises it with the code ``closed``. On an error, on the LLM's stream failing, or when the
consumer stops early (``break`` in a ``with contextlib.closing(...)``, ``aclosing`` for :func:`aspeak`, or its
task cancelled) the socket is closed, which ends the session at the gateway and upstream, and the LLM's stream is
closed (its ``close()`` / ``aclose()``), so neither keeps generating.

Over Triton's gRPC directly, the live clients take the text as it is::

    for chunk in LiveClient(url).tts_live(text_deltas(stream), speaker_id="alice"): ...
    async for chunk in AsyncLiveClient(url).tts_live(atext_deltas(stream), speaker_id="alice"): ...
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import threading
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator

from .live_ws import SAMPLE_RATE, LiveSpeechError
from .live_ws import SessionReader as _Reader
from .live_ws import auth_headers as _headers
from .live_ws import session_start as _start

__all__ = ["SAMPLE_RATE", "LiveSpeechError", "aspeak", "atext_deltas", "delta_text", "speak", "text_deltas"]

_END = json.dumps({"type": "input.end"})



# ---------------------------------------------------------------------------------------------- the text


def _field(obj, name: str):
    return obj.get(name) if isinstance(obj, dict) else getattr(obj, name, None)


def delta_text(chunk, choice: int = 0) -> str:
    """The text a chunk adds to choice ``choice`` ("" for none): a string is itself; a chat completion chunk
    (an object or its JSON as a dict) gives ``delta.content`` of the choice whose ``index`` is ``choice``."""
    if isinstance(chunk, str):
        return chunk
    for position, item in enumerate(_field(chunk, "choices") or ()):
        index = _field(item, "index")
        if (position if index is None else index) != choice:
            continue
        delta = _field(item, "delta")
        content = _field(delta, "content") if delta is not None else None
        return content if isinstance(content, str) else ""
    return ""


def text_deltas(stream: Iterable, *, choice: int = 0) -> Iterator[str]:
    """The non-empty text deltas of a chat completion stream (or of strings), in order, as they come."""
    for chunk in stream:
        if text := delta_text(chunk, choice):
            yield text


async def atext_deltas(stream: Iterable | AsyncIterable, *, choice: int = 0) -> AsyncIterator[str]:
    """:func:`text_deltas` of an async stream (the SDK's ``AsyncOpenAI``), or of a sync one read in a worker
    thread (the SDK's ``OpenAI`` blocks while it waits for the server)."""
    if isinstance(stream, AsyncIterable):
        async for chunk in stream:
            if text := delta_text(chunk, choice):
                yield text
        return
    chunks, done = iter(stream), object()
    while (chunk := await asyncio.to_thread(next, chunks, done)) is not done:
        if text := delta_text(chunk, choice):
            yield text


def _close(stream) -> None:
    with contextlib.suppress(Exception):  # a generator running in the sender's thread cannot be closed from here
        if callable(close := getattr(stream, "close", None)):
            close()


async def _aclose(stream) -> None:
    for name in ("aclose", "close"):
        if callable(method := getattr(stream, name, None)):
            with contextlib.suppress(Exception):
                result = method()
                if inspect.isawaitable(result):
                    await result
            return


# ---------------------------------------------------------------------------------------------- the session


def _pieces(text: str, most: int) -> Iterator[str]:
    """A delta as ``input.text`` messages of at most ``most`` characters (the gateway's bound)."""
    for start in range(0, len(text), most):
        yield json.dumps({"type": "input.text", "text": text[start : start + most]})


def speak(stream: Iterable, url: str, *, key: str | None = None, voice: str | None = None,
          reference_audio: bytes | str | None = None, reference_text: str | None = None, seed: int | None = None,
          output_format: str = "s16le", stream_format: str = "audio", choice: int = 0,
          **connect_options) -> Iterator[bytes]:
    """Speak a chat completion stream (or strings) over the gateway's ``/v1/audio/speech/live`` at ``url``
    (``ws://host:8080/v1/audio/speech/live``) with ``key``, in ``voice`` (one of ``GET /v1/audio/voices``) or of
    ``reference_audio`` (an encoded recording, bytes or base64; its ``reference_text``): the audio as it comes
    (see the module docstring). ``connect_options`` go to ``websockets.sync.client.connect`` (``open_timeout``,
    ``proxy``, ...)."""
    from websockets.exceptions import ConnectionClosed
    from websockets.sync.client import connect

    start = _start(voice, reference_audio, reference_text, seed, output_format, stream_format)
    reader, failed = _Reader(), []

    def send(ws) -> None:
        try:
            for text in text_deltas(stream, choice=choice):
                for message in _pieces(text, reader.most):
                    ws.send(message)
            ws.send(_END)
        except ConnectionClosed:
            return  # the reader sees the close
        except Exception as exc:  # the LLM's stream failed: the reader raises it
            failed.append(exc)
            ws.close(1011, "the text stream failed")

    try:
        with connect(url, additional_headers=_headers(key), **connect_options) as ws:
            sender = None
            with contextlib.suppress(ConnectionClosed):  # a refusal (its event read below) may come first
                ws.send(start)
            with contextlib.suppress(ConnectionClosed):
                for message in ws:
                    audio = reader.take(message)
                    if reader.started is not None and sender is None:
                        sender = threading.Thread(target=send, args=(ws,), name="llm-speech-send", daemon=True)
                        sender.start()
                    if audio:
                        yield audio
            reader.finish(ws.close_code, failed[0] if failed else None)
    finally:
        _close(stream)


async def aspeak(stream: Iterable | AsyncIterable, url: str, *, key: str | None = None, voice: str | None = None,
                 reference_audio: bytes | str | None = None, reference_text: str | None = None,
                 seed: int | None = None, output_format: str = "s16le", stream_format: str = "audio",
                 choice: int = 0, **connect_options) -> AsyncIterator[bytes]:
    """:func:`speak` with asyncio: ``stream`` async (``AsyncOpenAI``) or sync (read in a worker thread);
    ``connect_options`` go to ``websockets.asyncio.client.connect``."""
    from websockets.asyncio.client import connect
    from websockets.exceptions import ConnectionClosed

    start = _start(voice, reference_audio, reference_text, seed, output_format, stream_format)
    reader, deltas, failed = _Reader(), atext_deltas(stream, choice=choice), []

    async def send(ws) -> None:
        try:
            async for text in deltas:
                for message in _pieces(text, reader.most):
                    await ws.send(message)
            await ws.send(_END)
        except ConnectionClosed:
            return
        except Exception as exc:  # the LLM's stream failed: the reader raises it
            failed.append(exc)
            await ws.close(1011, "the text stream failed")

    sender = None
    try:
        async with connect(url, additional_headers=_headers(key), **connect_options) as ws:
            with contextlib.suppress(ConnectionClosed):  # a refusal (its event read below) may come first
                await ws.send(start)
            with contextlib.suppress(ConnectionClosed):
                async for message in ws:
                    audio = reader.take(message)
                    if reader.started is not None and sender is None:
                        sender = asyncio.ensure_future(send(ws))
                    if audio:
                        yield audio
            reader.finish(ws.close_code, failed[0] if failed else None)
    finally:
        if sender is not None:
            sender.cancel()
            with contextlib.suppress(BaseException):
                await sender
        await _aclose(deltas)
        await _aclose(stream)
