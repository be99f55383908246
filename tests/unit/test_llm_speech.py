"""An LLM's answer spoken as it is generated (:mod:`cosyvoice_triton.clients.llm_speech`): a chat completion
stream (the ``openai`` SDK's ``ChatCompletionChunk`` objects, their JSON as dicts, strings) read for its text, and
spoken over the gateway's ``/v1/audio/speech/live`` by the ``websockets`` client against the real gateway app
served by uvicorn in a thread, its upstream the stand-in of ``test_gateway_live_ws.py`` (one chunk per piece):
the text upstream is the deltas in order, the audio is the stand-in's, error events raise with their code, and a
consumer that stops, or an LLM stream that fails, closes the session and the LLM's stream."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import numpy as np
import pytest
from conftest import wait_until
from standin_gateway import served_in_thread
from test_gateway_live_ws import KEY_A, FakeLive, _app

from cosyvoice_triton.clients.llm_speech import (
    LiveSpeechError,
    aspeak,
    atext_deltas,
    delta_text,
    speak,
    text_deltas,
)
from cosyvoice_triton.clients.wire import VCError
from cosyvoice_triton.gateway.live_ws import TTS_LIVE_PATH

pytestmark = pytest.mark.timeout(120)

#: The answer, as an LLM streams it: multi-byte characters, a delta of one character, a long one.
DELTAS = ["Hello", ", ", "wörld", " — ", "你好", "🙂", " ", "ok.", " " + "x" * 150]
STANDIN_RATE = 24000


def _chunk(content=None, *, role=None, index=0, tool=False, finish=None) -> dict:
    delta: dict = {}
    if role is not None:
        delta["role"] = role
    if content is not None:
        delta["content"] = content
    if tool:
        delta["tool_calls"] = [{"index": 0, "id": "call_1", "type": "function",
                                "function": {"name": "lookup", "arguments": "{\"q\": \"ignored\"}"}}]
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": "m",
            "choices": [{"index": index, "delta": delta, "finish_reason": finish}]}


def _raw_stream() -> list[dict]:
    """The chunks as the server-sent events' JSON gives them: a role-only chunk, an empty one, a tool call, the
    deltas with a second choice's interleaved, a finish and a usage-only chunk (no choices)."""
    chunks = [_chunk(role="assistant", content=""), _chunk(tool=True), _chunk("")]
    for k, text in enumerate(DELTAS):
        chunks += [_chunk(text), _chunk(f"<other {k}>", index=1)]
    chunks += [_chunk(finish="stop"), {**_chunk(), "choices": [], "usage": {"prompt_tokens": 3,
                                                                          "completion_tokens": 9,
                                                                          "total_tokens": 12}}]
    return chunks


def _sdk_stream() -> list:
    """The same chunks as the SDK's objects when the ``openai`` package is installed, else as dicts."""
    try:
        from openai.types.chat import ChatCompletionChunk
    except ImportError:
        return _raw_stream()
    return [ChatCompletionChunk.model_validate(c) for c in _raw_stream()]


class LLM:
    """A chat completion stream, sync and async, that records being closed; ``fail``: raise after the chunks;
    ``hold``: after the chunks, wait (an LLM still thinking) until closed."""

    def __init__(self, chunks, *, fail: Exception | None = None, hold: bool = False):
        self.chunks, self.fail, self.hold = list(chunks), fail, hold
        self.closed = threading.Event()

    def __iter__(self):
        yield from self.chunks
        if self.fail is not None:
            raise self.fail
        while self.hold and not self.closed.wait(0.02):
            pass

    async def __aiter__(self):
        for c in self.chunks:
            await asyncio.sleep(0)
            yield c
        if self.fail is not None:
            raise self.fail
        while self.hold and not self.closed.is_set():
            await asyncio.sleep(0.02)

    def close(self):
        self.closed.set()


class RecordingLive(FakeLive):
    """The stand-in upstream, also keeping the waveform of each chunk it produced."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.waves: list[np.ndarray] = []

    async def _run(self, kind, pieces, kw):
        async with contextlib.aclosing(super()._run(kind, pieces, kw)) as chunks:
            async for chunk in chunks:
                self.waves.append(np.asarray(chunk.waveform, np.float32))
                yield chunk


@contextlib.contextmanager
def _gateway(live, **cfg):
    """The gateway app (two tenants' keys) on uvicorn in a thread: the live speech route's ws:// URL."""
    with served_in_thread(_app(live, **cfg)[1], lifespan="on") as port:
        yield f"ws://127.0.0.1:{port}{TTS_LIVE_PATH}"


OPTIONS = {"key": KEY_A, "voice": "alice", "proxy": None, "open_timeout": 30}


def _spoken(audio: list[bytes], output_format: str) -> np.ndarray:
    return np.concatenate([np.frombuffer(a, "<f4" if output_format == "f32le" else "<i2") for a in audio])


def _aspeak_all(stream, url, **kw) -> list[bytes]:
    async def run():
        async with contextlib.aclosing(aspeak(stream, url, **kw)) as audio:
            return [a async for a in audio]

    return asyncio.run(run())


# ---------------------------------------------------------------------------------------------- the text


def test_the_text_is_choice_zeros_non_empty_deltas_whatever_the_chunks_are():
    assert list(text_deltas(_sdk_stream())) == DELTAS
    assert list(text_deltas(_raw_stream())) == DELTAS
    assert list(text_deltas(["a", "", "b"])) == ["a", "b"]
    assert list(text_deltas(_raw_stream(), choice=1)) == [f"<other {k}>" for k in range(len(DELTAS))]
    assert delta_text({"choices": [{"delta": {"content": None}}]}) == ""
    assert delta_text({"choices": [{"delta": {"content": "no index: by position"}}]}) == "no index: by position"

    async def collect(stream):
        return [t async for t in atext_deltas(stream)]

    assert asyncio.run(collect(LLM(_sdk_stream()))) == DELTAS  # async iteration
    assert asyncio.run(collect(iter(_raw_stream()))) == DELTAS  # a sync stream, read in a thread


# ---------------------------------------------------------------------------------------------- sessions


@pytest.mark.parametrize(("mode", "output_format", "stream_format"), [
    ("sync", "s16le", "audio"), ("sync", "f32le", "events"), ("async", "f32le", "audio"),
    ("async", "s16le", "events")])
def test_the_answer_is_spoken_as_its_deltas_in_order(mode, output_format, stream_format):
    live, llm = RecordingLive(), LLM(_sdk_stream())
    kw = {**OPTIONS, "output_format": output_format, "stream_format": stream_format, "seed": 7}
    with _gateway(live, max_input_chars=100) as url:
        audio = list(speak(llm, url, **kw)) if mode == "sync" else _aspeak_all(llm, url, **kw)
    (rec,) = live.sessions
    assert rec["state"] == "ended" and rec["kw"]["speaker_id"] == "t-tenant_a.alice" and rec["kw"]["seed"] == 7
    assert "".join(rec["pieces"]) == "".join(DELTAS)
    assert rec["pieces"] == [*DELTAS[:-1], DELTAS[-1][:100], DELTAS[-1][100:]]  # cut at the gateway's bound
    assert len(audio) == len(live.waves)
    want = np.concatenate(live.waves)
    if output_format == "s16le":
        want = np.clip(np.round(want * 32767.0), -32768, 32767).astype("<i2")
        np.testing.assert_allclose(_spoken(audio, output_format), want, atol=1)
    else:
        np.testing.assert_array_equal(_spoken(audio, output_format), want)


def test_a_plain_iterator_of_strings_is_spoken():
    live = RecordingLive()
    with _gateway(live) as url:
        audio = list(speak(iter(["One ", "", "two."]), url, **OPTIONS))
    assert live.sessions[0]["pieces"] == ["One ", "two."] and len(audio) == 2


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize(("setup", "code"), [
    ({"live": {"refuse": VCError("unknown voice 'alice'", "StatusCode.INVALID_ARGUMENT")}}, "invalid_input"),
    ({"live": {"refuse": VCError("too many live sessions (4)", "StatusCode.UNAVAILABLE")}}, "capacity"),
    ({"options": {"key": "sk-wrong"}}, "invalid_api_key"),
    ({"options": {"voice": "../x"}}, "invalid_start"),
], ids=["refused", "capacity", "key", "voice"])
def test_the_gateways_error_event_raises_with_its_code(mode, setup, code):
    live, llm = RecordingLive(**setup.get("live", {})), LLM(_raw_stream(), hold=True)
    kw = {**OPTIONS, **setup.get("options", {})}
    with _gateway(live, live_idle_s=60.0) as url, pytest.raises(LiveSpeechError) as caught:
        t0 = time.monotonic()
        try:
            list(speak(llm, url, **kw)) if mode == "sync" else _aspeak_all(llm, url, **kw)
        finally:  # at once, while the deltas still come in (not after the gateway's idle time)
            assert time.monotonic() - t0 < 20.0
    assert caught.value.code == code and caught.value.status == code and code in str(caught.value)
    assert llm.closed.is_set()  # the LLM stops generating too
    assert all(s["state"] == "closed" for s in live.sessions)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_consumer_that_stops_closes_the_session_and_the_llm_stream(mode):
    live, llm = RecordingLive(), LLM(_raw_stream()[:6], hold=True)  # the LLM is still writing
    with _gateway(live) as url:
        if mode == "sync":
            audio = speak(llm, url, **OPTIONS)
            assert next(audio)
            audio.close()
        else:
            async def consume(got: asyncio.Event):
                async for _ in aspeak(llm, url, **OPTIONS):
                    got.set()

            async def run():
                got = asyncio.Event()
                task = asyncio.ensure_future(consume(got))
                await asyncio.wait_for(got.wait(), 30)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task

            asyncio.run(run())
        assert llm.closed.is_set()
        wait_until(lambda: live.sessions[0]["state"] != "open", "the stand-in's session to end")
        assert live.sessions[0]["state"] == "closed"  # ended before its input: the session was cut


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_an_llm_stream_that_fails_raises_its_error_and_ends_the_session(mode):
    live, llm = RecordingLive(), LLM(_raw_stream()[:6], fail=ConnectionError("the LLM server went away"))
    with _gateway(live) as url, pytest.raises(ConnectionError, match="went away"):
        list(speak(llm, url, **OPTIONS)) if mode == "sync" else _aspeak_all(llm, url, **OPTIONS)
    wait_until(lambda: live.sessions[0]["state"] != "open", "the stand-in's session to end")
    assert live.sessions[0]["state"] == "closed"
