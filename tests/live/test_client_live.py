"""Live-session clients (``cosyvoice_triton.clients.live``) and the CLI's ``--live``: the framing of one session on
one gRPC stream (random sequence id, START with the voice, pieces, an empty END), chunks charged to the piece that
caused them, the play-out margin, errors, early close, against a stand-in of tritonclient's gRPC stream that answers
as the live models' contract says (real ``tritonclient`` request and response objects). Then the same against a
real tritonserver, skipped with the reason while the server has no live models."""

from __future__ import annotations

import asyncio
import io
import math
import queue
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import soundfile as sf
from conftest import FIXTURES
from tritonclient.grpc import InferResult, service_pb2
from tritonclient.utils import deserialize_bytes_tensor

from cosyvoice_triton.clients.client import VCError
from cosyvoice_triton.clients.live import (
    AsyncLiveClient,
    LiveChunk,
    LiveClient,
    LiveStats,
    PacedPieces,
    pcm_pieces,
    text_pieces,
)
from cosyvoice_triton.errors import AudioError

SOURCE, PROMPT = FIXTURES / "source_en_5s.wav", FIXTURES / "prompt_en_3s.wav"
CLI = [sys.executable, "-m", "cosyvoice_triton", "client"]
OUT_SR = 24000


# ------------------------------------------------------------------------------------- the stand-in server


def _decode(infer_input) -> tuple[str, np.ndarray]:
    tensor, raw = infer_input._get_tensor(), infer_input._get_content()
    shape = list(tensor.shape)
    if tensor.datatype == "BYTES":
        return tensor.name, deserialize_bytes_tensor(raw).reshape(shape)
    dtype = {"FP32": np.float32, "INT32": np.int32, "INT64": np.int64}[tensor.datatype]
    return tensor.name, np.frombuffer(raw, dtype).reshape(shape)


def _result(request_id: str, outputs: dict[str, np.ndarray], final: bool) -> InferResult:
    r = service_pb2.ModelInferResponse(model_name="live", id=request_id)
    for name, arr in outputs.items():
        out = r.outputs.add()
        out.name, out.datatype = name, {np.dtype(np.float32): "FP32", np.dtype(np.int32): "INT32"}[arr.dtype]
        out.shape.extend(arr.shape)
        r.raw_output_contents.append(arr.tobytes())
    r.parameters["triton_final_response"].bool_param = final
    return InferResult(r)


class FakeLiveModel:
    """Answers live requests as the contract says. VC: a chunk of converted audio (24 kHz, ``hop_s`` of it) each
    time ``hop_s`` more source has arrived, on that piece's sender, the rest on END's; TTS: one chunk per text piece
    (its UTF-8 bytes' count of 2.4 ms frames) on that piece's sender. Every request gets its final response.
    ``speaker_id`` "nobody" is refused on the first request, as the server refuses an unknown speaker."""

    def __init__(self, kind: str = "vc", hop_s: float = 0.25, delay_s: float = 0.0):
        self.kind, self.hop_s, self.delay_s = kind, hop_s, delay_s
        self.requests: list[dict] = []  # what arrived: the framing and the decoded inputs
        self.received_at: list[float] = []
        self.seconds = self.emitted = 0.0
        self.chunks = self.pieces = 0
        self.text = b""

    def handle(self, request: dict) -> list[tuple[InferResult | None, Exception | None]]:
        self.received_at.append(time.perf_counter())
        inputs = dict(_decode(i) for i in request["inputs"])
        self.requests.append({**{k: v for k, v in request.items() if k != "inputs"}, "inputs": inputs})
        rid, out = request["request_id"], []
        if request["sequence_start"] and inputs.get("speaker_id", [[b""]])[0][0] == b"nobody":
            from tritonclient.utils import InferenceServerException

            # over a gRPC stream an error carries its message only: the live models put the code in front
            return [(None, InferenceServerException("INVALID_ARGUMENT: unknown speaker 'nobody'"))]
        if self.delay_s:
            time.sleep(self.delay_s)
        if self.kind == "vc":
            rate = int(inputs["source_sample_rate"][0, 0])
            self.seconds += inputs["source_audio"].shape[1] / rate
            while self.seconds - self.emitted >= self.hop_s - 1e-9 or (request["sequence_end"] and
                                                                 self.seconds - self.emitted > 1e-9):
                n = min(self.hop_s, self.seconds - self.emitted)
                self.emitted += n
                out.append(self._chunk(rid, round(n * OUT_SR), {"source_seconds": np.array([[self.seconds]],
                                                                                          np.float32)}))
        else:
            self.pieces += not request["sequence_end"]
            self.text += bytes(inputs["text"][0, 0])
            if inputs["text"][0, 0]:
                out.append(self._chunk(rid, 58 * len(bytes(inputs["text"][0, 0])),
                                       {"text_pieces": np.array([[self.pieces]], np.int32)}))
        return [*out, (_result(rid, {}, True), None)]

    def _chunk(self, rid: str, n: int, extra: dict) -> tuple[InferResult, None]:
        wave = np.full((1, n), 0.01 * (self.chunks + 1), np.float32)
        outputs = {"waveform": wave, "sample_rate": np.array([[OUT_SR]], np.int32),
                   "chunk_index": np.array([[self.chunks]], np.int32), **extra}
        self.chunks += 1
        return _result(rid, outputs, False), None


class FakeGrpc:
    """tritonclient.grpc.InferenceServerClient's stream calls over a :class:`FakeLiveModel`; answers come from
    another thread, as tritonclient's do."""

    def __init__(self, model: FakeLiveModel):
        self.model, self.stops, self.callback = model, [], None
        self._work: queue.Queue | None = None
        self.waiting = self.most_waiting = 0  # requests sent and not yet answered

    def start_stream(self, callback, **kw):
        assert self.callback is None, "one stream at a time"
        self.callback, self._work = callback, queue.Queue()
        threading.Thread(target=self._serve, args=(callback, self._work), daemon=True).start()

    def _serve(self, callback, work):
        while (request := work.get()) is not None:
            answers = self.model.handle(request)
            self.waiting -= 1
            for result, error in answers:
                callback(result, error)

    def async_stream_infer(self, model_name, inputs, *, enable_empty_final_response=False, **kw):
        assert self.callback is not None and enable_empty_final_response
        self.waiting += 1
        self.most_waiting = max(self.most_waiting, self.waiting)
        self._work.put({"model_name": model_name, "inputs": inputs, **kw})

    def stop_stream(self, cancel_requests=False):
        self.stops.append(cancel_requests)
        self._work.put(None)
        self.callback = None

    def close(self):
        pass


class FakeAioGrpc:
    """tritonclient.grpc.aio.InferenceServerClient.stream_infer over a :class:`FakeLiveModel`."""

    def __init__(self, model: FakeLiveModel):
        self.model, self.cancelled = model, []

    def stream_infer(self, requests):
        model, answers = self.model, asyncio.Queue()
        cancelled = self.cancelled

        async def pump():
            async for request in requests:
                assert request["parameters"] == {"triton_enable_empty_final_response": True}
                for item in model.handle({k: v for k, v in request.items() if k != "parameters"}):
                    answers.put_nowait(item)
            answers.put_nowait(None)

        task = asyncio.get_running_loop().create_task(pump())

        class Call:
            def __aiter__(self):
                return self

            async def __anext__(self):
                item = await answers.get()
                if item is None:
                    raise StopAsyncIteration
                return item

            def cancel(self):
                cancelled.append(True)
                task.cancel()

        return Call()

    async def close(self):
        pass


def _live_client(fake_model: FakeLiveModel, **kw) -> tuple[LiveClient, FakeGrpc]:
    kw.setdefault("timeout", 60)  # a stand-in answers at once: a hang fails within a minute
    client = LiveClient("127.0.0.1:1", **kw)  # nothing listens: every call goes to the stand-in
    fake = FakeGrpc(fake_model)
    client._client = fake
    return client, fake


@pytest.fixture(scope="module")
def source():
    wave, sr = sf.read(SOURCE, dtype="float32")
    return wave[: sr], sr  # 1 s


# ------------------------------------------------------------------------------------------------- framing


def test_vc_session_framing(source):
    wave, sr = source
    model = FakeLiveModel()
    client, fake = _live_client(model)
    pieces = [wave[:1600], wave[1600:1600], wave[1600:5000], wave[5000:]]  # the empty one is not sent
    stats = LiveStats()
    chunks = list(client.convert_live(pieces, prompt=PROMPT, sample_rate=sr, seed=7, stats=stats))
    reqs = model.requests
    assert [r["request_id"] for r in reqs] == ["0", "1", "2", "3"]
    assert [r["sequence_start"] for r in reqs] == [True, False, False, False]
    assert [r["sequence_end"] for r in reqs] == [False, False, False, True]
    ids = {r["sequence_id"] for r in reqs}
    assert len(ids) == 1 and 0 < ids.pop() < 2**63
    first = reqs[0]["inputs"]
    assert set(first) == {"source_audio", "source_sample_rate", "prompt_audio", "prompt_sample_rate", "seed"}
    assert first["seed"][0, 0] == 7 and first["prompt_sample_rate"][0, 0] == sf.info(PROMPT).samplerate
    assert all(set(r["inputs"]) == {"source_audio", "source_sample_rate"} for r in reqs[1:])
    assert all(r["inputs"]["source_sample_rate"][0, 0] == sr for r in reqs)
    sent = np.concatenate([r["inputs"]["source_audio"][0] for r in reqs])
    np.testing.assert_array_equal(sent, wave)  # every sample once, in order; END carries none
    assert reqs[-1]["inputs"]["source_audio"].shape == (1, 0)
    # the chunks: every hop of source, the rest flushed on END; each charged to the piece that completed it
    assert [c.index for c in chunks] == list(range(len(chunks))) and len(chunks) == 4
    assert sum(len(c.waveform) for c in chunks) == OUT_SR
    ends = np.cumsum([1600, 3400, len(wave) - 5000]) / sr  # after each piece sent (the empty one is not)
    for c in chunks:
        assert isinstance(c, LiveChunk) and c.sample_rate == OUT_SR
        assert c.piece == int(np.searchsorted(ends, c.source_seconds - 1e-6)), (c.piece, c.source_seconds)
        assert c.latency_s >= 0
    assert stats.pieces == 3 and math.isclose(stats.source_seconds, 1.0, rel_tol=1e-6)
    assert stats.chunks == 4 and stats.samples == OUT_SR and len(stats.latencies_s) == 4
    assert fake.stops == [False]  # ended: nothing to cancel


def test_multichannel_pieces_keep_the_stream_s_layout(source):
    """A piece is [N] or [N, C] frames, C fixed by the first piece: one stereo frame [1, 2] is one sample, a
    [2, 2] piece two frames (averaged over channels, never over time); a piece with other channels is refused."""
    wave, sr = source
    stereo = np.stack([wave, -0.5 * wave], axis=1)  # [N, 2]
    model = FakeLiveModel()
    client, _ = _live_client(model)
    pieces = [stereo[:1], stereo[1:3], stereo[3:2000], stereo[2000:]]
    list(client.convert_live(pieces, prompt=PROMPT, sample_rate=sr))
    sent = [r["inputs"]["source_audio"][0] for r in model.requests[:-1]]
    assert [len(x) for x in sent] == [1, 2, 1997, len(wave) - 2000]
    np.testing.assert_allclose(np.concatenate(sent), 0.25 * wave, rtol=1e-6, atol=1e-7)
    model = FakeLiveModel()
    client, _ = _live_client(model)
    with pytest.raises(AudioError, match="the stream's pieces have 2"):
        list(client.convert_live([stereo[:100], wave[100:200]], prompt=PROMPT, sample_rate=sr))


def test_sessions_get_their_own_sequence_ids_and_the_client_is_reused(source):
    wave, sr = source
    model = FakeLiveModel()
    client, fake = _live_client(model)
    for _ in range(3):
        list(client.convert_live([wave], speaker_id="alice", sample_rate=sr))
    starts = [r for r in model.requests if r["sequence_start"]]
    assert len(starts) == 3 and len({r["sequence_id"] for r in starts}) == 3
    assert all(r["inputs"]["speaker_id"][0, 0] == b"alice" and "prompt_audio" not in r["inputs"] for r in starts)
    assert fake.stops == [False] * 3


def test_voice_is_checked_before_anything_is_sent(source):
    wave, sr = source
    client, fake = _live_client(FakeLiveModel())
    with pytest.raises(Exception, match="prompt audio or a registered speaker_id"):
        client.convert_live([wave], sample_rate=sr)
    with pytest.raises(Exception, match="prompt audio or a registered speaker_id"):
        client.convert_live([wave], prompt=PROMPT, speaker_id="alice", sample_rate=sr)
    with pytest.raises(Exception, match="sample_rate"):
        client.convert_live([wave], speaker_id="alice")
    with pytest.raises(ValueError, match="gRPC"):
        LiveClient("127.0.0.1:1", protocol="http")
    assert fake.callback is None and not fake.model.requests


def test_paced_pieces_come_at_real_time(source):
    wave, sr = source
    pieces = PacedPieces(wave[: sr // 2], sample_rate=sr, piece_ms=100)
    assert pieces.sample_rate == sr and math.isclose(pieces.seconds, 0.5)
    model = FakeLiveModel()
    client, _ = _live_client(model)
    list(client.convert_live(pieces, speaker_id="alice"))  # the rate comes with the pieces
    arrived = np.array(model.received_at[:5]) - model.received_at[0]
    # piece k is given out once it "has been recorded", (k + 1) * 100 ms after the start: never earlier
    assert np.all(arrived[1:] >= np.arange(1, 5) * 0.1 - 0.01), arrived
    fast = PacedPieces(wave, sample_rate=sr, piece_ms=100, realtime=False)
    np.testing.assert_array_equal(np.concatenate(list(fast)), wave)
    assert len(list(fast)) == 10


def test_paced_pieces_of_a_file():
    pieces = PacedPieces(SOURCE, piece_ms=250, realtime=False)
    wave, sr = sf.read(SOURCE, dtype="float32")
    assert pieces.sample_rate == sr
    got = list(pieces)
    assert all(len(p) == sr // 4 for p in got[:-1])
    np.testing.assert_allclose(np.concatenate(got), wave, atol=1e-7)


# ------------------------------------------------------------------------------------------- timing


def _chunk(seconds: float, elapsed: float, latency: float = 0.1) -> LiveChunk:
    return LiveChunk(np.zeros(round(seconds * 1000), np.float32), 1000, 0, elapsed, latency_s=latency)


def test_play_out_margin_and_underruns():
    stats = LiveStats()
    arrivals = [(1.0, 0.5), (1.4, 0.5), (1.9, 0.5), (2.6, 0.5), (2.7, 0.5)]  # (arrival, seconds of audio)
    chunks = [_chunk(s, a - 0.5) for a, s in arrivals]
    for (arrival, _), chunk in zip(arrivals, chunks, strict=True):
        stats.add(chunk, arrival)
    # playback: 1.0-1.5, 1.5-2.0, 2.0-2.5, stall 0.1, 2.6-3.1, 3.1-3.6
    assert chunks[0].margin_s is None
    assert [round(c.margin_s, 6) for c in chunks[1:]] == [0.1, 0.1, -0.1, 0.4]
    assert stats.underruns == 1 and math.isclose(stats.stall_s, 0.1) and math.isclose(stats.margin_s, -0.1)
    assert math.isclose(stats.needed_buffer_s, 0.1)  # chunk 3 came 0.1 s after 1.5 s of audio from 1.0
    assert stats.first_audio_s == 0.5 and stats.total_s == 2.2 and math.isclose(stats.audio_seconds, 2.5)
    assert math.isclose(stats.rtf, 2.2 / 2.5)
    buffered = LiveStats(buffer_s=0.2)
    for (arrival, seconds), _ in zip(arrivals, chunks, strict=True):
        buffered.add(_chunk(seconds, arrival - 0.5), arrival)
    assert buffered.underruns == 0 and math.isclose(buffered.margin_s, 0.1)
    assert math.isclose(buffered.needed_buffer_s, stats.needed_buffer_s)  # whatever the buffer
    assert "1 underruns" in stats.summary() and "margin -100 ms" in stats.summary()


def test_latency_is_charged_to_the_piece_that_caused_the_chunk(source):
    wave, sr = source
    model = FakeLiveModel(hop_s=0.2, delay_s=0.05)  # the server takes 50 ms per piece
    client, _ = _live_client(model)
    stats = LiveStats()
    chunks = list(client.convert_live(PacedPieces(wave, sample_rate=sr, piece_ms=100), speaker_id="a",
                                      stats=stats))
    assert [c.piece for c in chunks] == [1, 3, 5, 7, 9]  # every second piece completes a hop
    assert all(c.latency_s >= 0.05 for c in chunks)  # at least the server's time on that piece
    assert stats.latency_ms(50) >= 50 and stats.latency_ms(95) >= stats.latency_ms(50)


# ------------------------------------------------------------------------------------ errors, early close


def test_server_error_raises_with_its_message_and_ends_the_stream(source):
    wave, sr = source
    model = FakeLiveModel()
    client, fake = _live_client(model)
    with pytest.raises(VCError, match="unknown speaker 'nobody'") as info:
        list(client.convert_live([wave[:800], wave[800:]], speaker_id="nobody", sample_rate=sr))
    assert info.value.invalid_argument and info.value.message == "unknown speaker 'nobody'"
    assert model.requests[-1]["sequence_end"]  # the end of the sequence still went
    assert fake.stops == [True]
    assert list(client.convert_live([wave], speaker_id="alice", sample_rate=sr))  # usable again


def test_error_codes_from_the_message():
    from tritonclient.utils import InferenceServerException

    from cosyvoice_triton.clients.live import live_error
    from cosyvoice_triton.clients.retry import is_retryable

    busy = live_error(InferenceServerException("UNAVAILABLE: cosyvoice_vc_live: too many live sessions (4)"))
    assert busy.status == "StatusCode.UNAVAILABLE" and busy.message == "cosyvoice_vc_live: too many live sessions (4)"
    assert is_retryable(busy) and not busy.invalid_argument
    unknown = live_error(InferenceServerException("inference request for sequence 7 to model 'cosyvoice_vc_live' "
                                                  "must specify the START flag on the first request of the sequence"))
    assert unknown.invalid_argument and "sequence 7" in unknown.message
    plain = live_error(InferenceServerException("Something: else"))
    assert plain.status is None and plain.message == "Something: else"


def test_pieces_wait_while_the_server_is_behind(source):
    wave, sr = source
    model = FakeLiveModel(delay_s=0.02)
    client, fake = _live_client(model)
    pieces = [wave[i : i + 400] for i in range(0, len(wave), 400)]  # all at once, faster than the server
    chunks = list(client.convert_live(pieces, speaker_id="alice", sample_rate=sr))
    assert len(model.requests) == len(pieces) + 1 and sum(len(c.waveform) for c in chunks) == OUT_SR
    # never more waiting than max_in_flight: the server's back-pressure refusal (8 waiting) cannot come
    assert fake.most_waiting == LiveClient.max_in_flight


def test_closing_early_sends_the_end_and_stops(source):
    wave, sr = source
    model = FakeLiveModel(hop_s=0.1)
    client, fake = _live_client(model)

    def endless():
        while True:
            yield wave[:1600]
            time.sleep(0.01)

    chunks = client.convert_live(endless(), speaker_id="alice", sample_rate=sr)
    first = next(chunks)
    chunks.close()
    assert first.index == 0
    ends = [r for r in model.requests if r["sequence_end"]]
    assert len(ends) == 1 and model.requests[-1]["sequence_end"]
    assert len(fake.stops) == 1


def test_an_error_of_the_pieces_reaches_the_caller(source):
    wave, sr = source
    model = FakeLiveModel()
    client, fake = _live_client(model)

    def broken():
        yield wave[:1600]
        raise OSError("the microphone went away")

    with pytest.raises(OSError, match="microphone went away"):
        list(client.convert_live(broken(), speaker_id="alice", sample_rate=sr))
    assert model.requests[-1]["sequence_end"] and len(fake.stops) == 1


# ------------------------------------------------------------------------------------------------------ TTS


def test_tts_session_framing_and_split_characters():
    model = FakeLiveModel("tts")
    client, fake = _live_client(model, model="cosyvoice_tts_live")
    word = "天气".encode()
    pieces = ["Hello ", "", word[:2], word[2:], "there."]
    stats = LiveStats()
    chunks = list(client.tts_live(pieces, prompt=PROMPT, prompt_text="A prompt.", seed=3, stats=stats))
    reqs = model.requests
    assert reqs[0]["model_name"] == "cosyvoice_tts_live" and reqs[0]["sequence_start"]
    assert set(reqs[0]["inputs"]) == {"text", "prompt_audio", "prompt_sample_rate", "prompt_text", "seed"}
    assert reqs[0]["inputs"]["prompt_text"][0, 0] == b"A prompt."
    assert [set(r["inputs"]) for r in reqs[1:]] == [{"text"}] * 4
    assert reqs[-1]["sequence_end"] and reqs[-1]["inputs"]["text"][0, 0] == b""
    assert model.text.decode() == "Hello 天气there."  # the split character arrives whole
    assert [c.piece for c in chunks] == [0, 1, 2, 3] == [c.text_pieces - 1 for c in chunks]
    assert stats.first_audio_s is not None and stats.first_audio_s == chunks[0].elapsed_s
    assert fake.stops == [False]
    with pytest.raises(Exception, match="str or bytes"):
        list(client.tts_live([b"ok", 5], speaker_id="alice"))


def test_text_pieces_from_lines():
    lines = io.StringIO("Hello there.\nHow are\n\nyou")
    assert list(text_pieces(lines)) == ["Hello there. ", "How are ", " ", "you"]
    assert list(text_pieces(["abcdefg\n"], chunk_chars=3)) == ["abc", "def", "g "]


def test_pcm_pieces_from_a_stream():
    pcm = (np.arange(1001, dtype=np.int16) * 7).astype("<i2")
    data = pcm.tobytes() + b"\x01"  # a stray byte at the end is dropped

    class Trickle(io.RawIOBase):  # short reads that split samples, as a pipe may give
        def __init__(self):
            self.pos = 0

        def read(self, n=-1):
            out = data[self.pos : self.pos + min(n, 333)]
            self.pos += len(out)
            return out

    for stream in (io.BytesIO(data), Trickle()):
        pieces = list(pcm_pieces(stream, sample_rate=16000, piece_ms=20))  # 320 samples each
        np.testing.assert_array_equal(np.concatenate(pieces), pcm)
        assert all(p.dtype == np.dtype("<i2") for p in pieces)
    assert [len(p) for p in pcm_pieces(io.BytesIO(data), sample_rate=16000, piece_ms=20)] == [320, 320, 320, 41]


# ---------------------------------------------------------------------------------------------------- asyncio


def _async_client(fake_model: FakeLiveModel, **kw) -> AsyncLiveClient:
    client = AsyncLiveClient("127.0.0.1:1", **{"timeout": 60, **kw})
    client._client = FakeAioGrpc(fake_model)
    return client


def test_async_session_equals_sync(source):
    wave, sr = source
    pieces = [wave[:1600], wave[1600:5000], wave[5000:]]
    sync_model = FakeLiveModel()
    client, _ = _live_client(sync_model)
    want = list(client.convert_live(pieces, prompt=PROMPT, sample_rate=sr, seed=2))

    async def agen():
        for p in pieces:
            await asyncio.sleep(0)
            yield p

    async def run():
        model = FakeLiveModel()
        c = _async_client(model)
        stats = LiveStats()
        got = [ch async for ch in c.convert_live(agen(), prompt=PROMPT, sample_rate=sr, seed=2, stats=stats)]
        return model, got, stats

    model, got, stats = asyncio.run(run())
    assert [(r["request_id"], r["sequence_start"], r["sequence_end"]) for r in model.requests] == \
        [(r["request_id"], r["sequence_start"], r["sequence_end"]) for r in sync_model.requests]
    assert model.requests[0]["sequence_id"] != sync_model.requests[0]["sequence_id"]
    assert [(c.index, c.piece, len(c.waveform)) for c in got] == [(c.index, c.piece, len(c.waveform)) for c in want]
    assert stats.chunks == len(got) and stats.pieces == 3


def test_async_error_early_close_and_tts(source):
    wave, sr = source

    async def run():
        model = FakeLiveModel(hop_s=0.1)
        c = _async_client(model)
        with pytest.raises(VCError, match="unknown speaker 'nobody'"):
            async for _ in c.convert_live([wave], speaker_id="nobody", sample_rate=sr):
                pass

        async def endless():
            while True:
                yield wave[:1600]
                await asyncio.sleep(0.01)

        gen = c.convert_live(endless(), speaker_id="alice", sample_rate=sr)
        first = await gen.__anext__()
        await gen.aclose()
        tts_model = FakeLiveModel("tts")
        t = _async_client(tts_model, model="cosyvoice_tts_live")
        spoken = [ch async for ch in t.tts_live(["Hi ", "there."], speaker_id="alice")]
        return model, c._client.cancelled, first, tts_model, spoken

    model, cancelled, first, tts_model, spoken = asyncio.run(run())
    assert first.index == 0
    assert sum(r["sequence_end"] for r in model.requests) == 2  # the refused session's and the closed one's
    assert len(cancelled) >= 1
    assert tts_model.text == b"Hi there." and [c.piece for c in spoken] == [0, 1]


# -------------------------------------------------------------------------------------------------------- CLI


def _cli_module():
    from cosyvoice_triton.clients import cli

    return cli


class _Stdin:
    def __init__(self, data: bytes):
        self.buffer = io.BytesIO(data)
        self._text = io.StringIO(data.decode("utf-8", "replace"))

    def __iter__(self):
        return iter(self._text)


def test_cli_vc_live_from_stdin_to_stdout(monkeypatch, capsysbinary, source):
    wave, sr = source
    cli = _cli_module()
    model = FakeLiveModel()

    class Client(LiveClient):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self._client = FakeGrpc(model)

        def is_ready(self):
            return self.model == "cosyvoice_vc_live"

    monkeypatch.setattr(cli, "LiveClient", Client)
    pcm = np.rint(wave * 32767).astype("<i2")
    monkeypatch.setattr(sys, "stdin", _Stdin(pcm.tobytes()))
    rc = cli.main(["vc", "--live", "-", "--rate", str(sr), "--speaker", "alice", "--piece-ms", "100", "-o", "-"])
    out, err = capsysbinary.readouterr()
    assert rc == 0, err.decode()
    assert len(np.frombuffer(out, "<i2")) == OUT_SR  # 1 s of source -> 1 s at 24 kHz, all of it on stdout
    sent = np.concatenate([r["inputs"]["source_audio"][0] for r in model.requests])
    np.testing.assert_allclose(sent, pcm / 32768.0, atol=1e-7)
    report = err.decode()
    assert report.count("latency") >= 4 and "real-time margin" in report and "stdin -> stdout" in report


def test_cli_tts_live_reads_stdin(monkeypatch, capsys, tmp_path):
    cli = _cli_module()
    model = FakeLiveModel("tts")

    class Client(LiveClient):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self._client = FakeGrpc(model)

        def is_ready(self):
            return self.model == "cosyvoice_tts_live"

    monkeypatch.setattr(cli, "LiveClient", Client)
    monkeypatch.setattr(sys, "stdin", _Stdin(b"Hello there.\nGood morning.\n"))
    out = tmp_path / "live.wav"
    assert cli.main(["tts", "--live", "--speaker", "alice", "--chunk-chars", "5", "-o", str(out)]) == 0
    texts = [bytes(r["inputs"]["text"][0, 0]).decode() for r in model.requests]
    assert texts == ["Hello", " ther", "e. ", "Good ", "morni", "ng. ", ""]
    err = capsys.readouterr().err
    assert "tts -> " in err and "first audio after" in err
    assert sf.info(out).frames == 58 * len("Hello there. Good morning. ")
    assert cli.main(["tts", "--live", "--speaker", "alice", "--protocol", "http", "-o", "-"]) == 2


# --------------------------------------------------------------------------------------------- live server


def _live_ready(server, model: str) -> str | None:
    with LiveClient(server.grpc_url, model=model, timeout=60) as c:
        return None if c.is_ready() else f"the server has no {model} model (live serving not rendered yet)"


@pytest.fixture(scope="module")
def vc_live_server(triton_server):
    reason = _live_ready(triton_server, "cosyvoice_vc_live")
    if reason:
        pytest.skip(reason)
    return triton_server


def test_live_vc_against_the_server(vc_live_server, tmp_path):
    stats = LiveStats()
    with LiveClient(vc_live_server.grpc_url, timeout=300) as c:
        pieces = PacedPieces(SOURCE, piece_ms=200, realtime=False)
        chunks = list(c.convert_live(pieces, prompt=PROMPT, seed=5, stats=stats))
        again = list(c.convert_live(PacedPieces(SOURCE, piece_ms=200, realtime=False), prompt=PROMPT, seed=5))
        with pytest.raises(VCError, match="no_such_voice"):
            list(c.convert_live(PacedPieces(SOURCE, piece_ms=200, realtime=False), speaker_id="no_such_voice"))
    assert chunks and [ch.index for ch in chunks] == list(range(len(chunks)))
    seconds = sum(len(ch.waveform) for ch in chunks) / chunks[0].sample_rate
    assert abs(seconds - pieces.seconds) < 0.25, seconds  # the whole source, converted
    assert all(ch.latency_s >= 0 and 0 <= ch.piece < stats.pieces + 1 for ch in chunks)
    assert stats.first_audio_s is not None and len(stats.latencies_s) == len(chunks)
    for a, b in zip(chunks, again, strict=True):  # same source, voice and seed: the same audio
        np.testing.assert_array_equal(a.waveform, b.waveform)
    out = tmp_path / "live.wav"
    proc = subprocess.run([*CLI, "vc", "--url", vc_live_server.grpc_url, "--live", str(SOURCE), "--prompt",
                           str(PROMPT), "--seed", "5", "--piece-ms", "200", "-o", str(out)], capture_output=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr.decode()
    assert "real-time margin" in proc.stderr.decode()
    written, sr = sf.read(out, dtype="float32")
    assert sr == chunks[0].sample_rate and abs(len(written) / sr - seconds) < 1e-3


def test_live_tts_against_the_server(triton_server, tmp_path):
    reason = _live_ready(triton_server, "cosyvoice_tts_live")
    if reason:
        pytest.skip(reason)
    stats = LiveStats()
    with LiveClient(triton_server.grpc_url, model="cosyvoice_tts_live", timeout=300) as c:
        chunks = list(c.tts_live(["Hello ", "there. ", "How are ", "you?"], prompt=PROMPT, seed=1, stats=stats))
    assert chunks and stats.first_audio_s is not None and stats.samples > 0
    assert all(0 <= ch.piece <= 4 for ch in chunks)
    proc = subprocess.run([*CLI, "tts", "--url", triton_server.grpc_url, "--live", "--prompt", str(PROMPT),
                           "--chunk-chars", "4", "-o", str(tmp_path / "t.wav")], input=b"Hello there.\n",
                          capture_output=True, timeout=600)
    assert proc.returncode == 0, proc.stderr.decode()
    assert "first audio after" in proc.stderr.decode() and sf.info(tmp_path / "t.wav").frames > 0


# ------------------------------------------------------------------------------------ the live figures' report


def test_live_figures_summary_and_report():
    from cosyvoice_triton.loadtest.live import commit, render_markdown, summarize_level

    good = {"source_s": 10.0, "audio_s": 10.0, "chunks": 10, "latencies_s": [0.5] * 9 + [1.5],
            "first_audio_s": 1.2, "margin_s": 0.05, "underruns": 0, "stall_s": 0.0, "needed_buffer_s": 0.1}
    late = {**good, "margin_s": -0.3, "underruns": 2, "stall_s": 0.5, "needed_buffer_s": 0.6}
    one = summarize_level(1, [good])
    assert one["held"] and one["chunks"] == 10 and one["latency_p50_ms"] == 500.0 and one["min_margin_ms"] == 50.0
    two = summarize_level(2, [good, late])
    assert not two["held"] and two["underruns"] == 2 and two["min_margin_ms"] == -300.0
    assert two["needed_buffer_max_ms"] == 600.0 and two["latency_p95_ms"] > two["latency_p50_ms"]
    failed = summarize_level(2, [good, {"error": "VCError: at capacity"}])
    assert not failed["held"] and failed["failed"] == 1 and failed["errors"] == ["VCError: at capacity"]
    report = {"setup": {"commit": commit(), "load average at start": "1.00"}, "levels": [one, two, failed],
              "held_streams": 1, "tried": [1, 2, 2], "fast": {"source_s": 10.0, "total_s": 4.0, "rtf": 0.4,
                                                              "p50_ms": 300.0, "p95_ms": 900.0},
              "tts": [{"text": "Hi there.", "pieces": 2, "first_audio_ms": 640.0, "audio_s": 1.0, "total_s": 2.0}]}
    md = render_markdown(report)
    assert "Held at real time (no underrun, no failed stream): 1 concurrent" in md
    assert "| 2 | 20 | 500 |" in md and "VCError: at capacity" in md and "real-time factor 0.400" in md
    assert "| Hi there. | 2 | 640 |" in md and report["setup"]["commit"] in md
    assert "Live TTS: skipped: x." in render_markdown({**report, "tts": "skipped: x"})


def test_live_figures_side_by_side_over_the_gateway():
    from cosyvoice_triton.loadtest.live import _vias, parser, render_markdown, summarize_level

    row = {"source_s": 10.0, "audio_s": 10.0, "chunks": 10, "latencies_s": [0.5] * 10, "first_audio_s": 1.0,
           "margin_s": 0.05, "underruns": 0, "stall_s": 0.0, "needed_buffer_s": 0.1}
    slower = {**row, "latencies_s": [0.56] * 10, "first_audio_s": 1.2, "underruns": 1, "margin_s": -0.01}
    levels = [summarize_level(1, [row]), summarize_level(1, [slower], "ws")]
    assert levels[1]["via"] == "ws" and not levels[1]["held"]
    report = {"setup": {"commit": "abc"}, "levels": levels, "held_streams": 1, "held_by_via": {"grpc": 1, "ws": 0},
              "tried": [1], "fast": {"error": "x"},
              "tts": [{"via": "ws", "text": "Hi.", "pieces": 1, "first_audio_ms": 700.0, "audio_s": 1.0,
                       "total_s": 1.5}]}
    md = render_markdown(report)
    assert "Triton gRPC directly 1 concurrent live VC stream(s); gateway WebSocket 0 concurrent" in md
    assert "| grpc | 1 | 10 | 500 |" in md and "| ws | 1 | 10 | 560 |" in md
    assert "| 1 | 60 | 60 | 200 | 0 / 1 |" in md  # what the door adds: ws minus grpc
    assert "| ws | Hi. | 1 | 700 |" in md
    assert parser().parse_args(["--via", "ws,grpc,ws"]).via == ("ws", "grpc")
    with pytest.raises(Exception, match="comma-separated"):
        _vias("grpc,http")
