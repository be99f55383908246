"""Live sessions over WebSocket at a real gateway (``python -m cosyvoice_triton.gateway``, two tenants of a keys
file) in front of a real tritonserver (local flavor, tiny demo model, both live models), with the ``websockets``
client a browser-side or LLM-side program would use:

* the audio a WebSocket session gets for given pieces (VC: binary frames of samples, float32 and 16-bit; TTS: text
  deltas) equals what a direct gRPC live session (:class:`~cosyvoice_triton.clients.live.LiveClient` on Triton)
  gets for the same pieces, voice and seed, within the bar of the gateway's sessions test (rel 1e-3; the float32
  path is bit for bit);
* hostile and broken clients: a wrong rate, an oversized frame, a wrong key, a tenant over its share of a live
  model (while another tenant's session beside it speaks as alone), a session whose input stops (cut at the
  gateway's idle time), a client that vanishes without a close: each gets its error event and close code where
  it can still read one, and Triton's ``cosyvoice_live_sessions``, the gateway's ``cosyvoice_gateway_sequences``
  and ``cosyvoice_gateway_live_sessions`` come back to 0.

The protocol's every branch on a stand-in upstream: ``tests/unit/test_gateway_live_ws.py``."""

from __future__ import annotations

import base64
import contextlib
import json
import threading
import time
import urllib.request

import numpy as np
import pytest
import soundfile as sf
from conftest import FIXTURES, PATIENCE_S, PATIENT_TEST_S, gateway_process, live_models_served, rel_err, wait_until

pytest.importorskip("tritonclient.grpc")
ws_client = pytest.importorskip("websockets.sync.client")

from cosyvoice_triton.clients.live import LiveClient  # noqa: E402
from cosyvoice_triton.gateway.audio import pcm16  # noqa: E402
from cosyvoice_triton.gateway.live_ws import SUBPROTOCOL, TTS_LIVE_PATH, VC_LIVE_PATH  # noqa: E402

pytestmark = pytest.mark.timeout(PATIENT_TEST_S)

VC, TTS = "cosyvoice_vc_live", "cosyvoice_tts_live"
KEY_A, KEY_B = "sk-live-ws-a", "sk-live-ws-b"
IDLE_S = 3.0
SEED = 5
PROMPT = FIXTURES / "prompt_en_3s.wav"
TEXTS = ["Hello there, ", "this is a ", "live session ", "over a socket."]
BAR = 1e-3  # test_gateway_sessions_live.py's bar for a served session against the same session alone


@pytest.fixture(scope="module")
def server(serving_assets, tmp_path_factory):
    with live_models_served(serving_assets, tmp_path_factory.mktemp("live_ws")) as s:
        yield s


@pytest.fixture(scope="module")
def gateway(server, tmp_path_factory):
    folder = tmp_path_factory.mktemp("live_ws_gateway")
    with gateway_process(server, folder / "gateway.log", "--open-metrics", "--live-idle-s", str(IDLE_S),
                         tenants={"tenant_a": KEY_A, "tenant_b": KEY_B}) as urls:
        yield urls


@pytest.fixture(scope="module")
def source():
    """The source in 500 ms pieces at its own rate (24 kHz), float32 and 16-bit."""
    pcm, rate = sf.read(FIXTURES / "source_en_5s.wav", dtype="int16")
    n = rate // 2
    ints = [pcm[i: i + n] for i in range(0, len(pcm), n)]
    return rate, ints, [p.astype(np.float32) / 32768.0 for p in ints]


class Socket:
    """One WebSocket session: what the server sent (events, binary frames), read in a thread until it closes."""

    def __init__(self, gateway, path: str, key: str | None = KEY_A, subprotocols=None):
        headers = {"authorization": f"Bearer {key}"} if key and not subprotocols else None
        self.stack = contextlib.ExitStack()
        self.ws = self.stack.enter_context(ws_client.connect(
            f"ws://{gateway.http}{path}", additional_headers=headers, subprotocols=subprotocols, proxy=None,
            max_size=None, open_timeout=PATIENCE_S))
        self.events, self.frames, self.closed = [], [], threading.Event()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        try:
            for message in self.ws:
                if isinstance(message, bytes):
                    self.frames.append(message)
                else:
                    self.events.append(json.loads(message))
        except Exception:  # a connection cut (the vanishing client's own socket)
            pass
        finally:
            self.closed.set()

    def send(self, message) -> None:
        self.ws.send(json.dumps(message) if isinstance(message, dict) else message)

    def started(self) -> dict:
        wait_until(lambda: self.events or self.closed.is_set(), "session.started")
        assert self.events and self.events[0]["type"] == "session.started", self.events
        return self.events[0]["session"]

    def finish(self) -> int:
        """Until the server closes: its close code."""
        assert self.closed.wait(PATIENCE_S), "the server did not close the session"
        return self.ws.close_code

    def refused(self, code: str) -> dict:
        close = self.finish()
        errors = [e["error"] for e in self.events if e["type"] == "error"]
        assert len(errors) == 1 and errors[0]["code"] == code, self.events
        from cosyvoice_triton.gateway.live_ws import ERRORS

        assert close == ERRORS[code][1], (close, code)
        return errors[0]

    def done(self) -> list[bytes]:
        """The whole session's audio frames, after a done event and a normal close."""
        assert self.finish() == 1000, self.events
        assert self.events[-1]["type"] == "speech.audio.done", self.events[-3:]
        return self.frames

    def close(self) -> None:
        self.stack.close()


def _metric(url: str, name: str, model: str | None = None, **labels: str) -> float:
    from cosyvoice_triton.loadtest.metrics import parse_prometheus

    if model is not None:
        labels["model"] = model
    with urllib.request.urlopen(url, timeout=30) as r:
        series = parse_prometheus(r.read().decode())
    return sum(s.value for s in series if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def _all_freed(server, gateway) -> None:
    for model in (VC, TTS):
        wait_until(lambda m=model: _metric(server.metrics_url, "cosyvoice_live_sessions", m) == 0,
                   f"Triton's {model} sessions back to 0")
    wait_until(lambda: _metric(gateway.base + "/metrics", "cosyvoice_gateway_sequences") == 0,
               "the gateway's sequence ids back to 0")
    wait_until(lambda: _metric(gateway.base + "/metrics", "cosyvoice_gateway_live_sessions") == 0,
               "the gateway's live sessions back to 0")


def _vc_start(rate: int, fmt: str = "f32le") -> dict:
    return {"type": "session.start", "reference_audio": base64.b64encode(PROMPT.read_bytes()).decode(),
            "sample_rate": rate, "sample_format": fmt, "output_format": fmt, "seed": SEED}


def _tts_start() -> dict:
    return {"type": "session.start", "reference_audio": base64.b64encode(PROMPT.read_bytes()).decode(),
            "reference_text": "A prompt.", "seed": SEED, "output_format": "f32le"}


def _vc_live(server, gateway, source, pieces: int = 1) -> Socket:
    """A voice conversion session started, its first ``pieces`` sent (float32), live on Triton."""
    rate, _, floats = source
    s = Socket(gateway, VC_LIVE_PATH)
    s.send(_vc_start(rate))
    s.started()
    for piece in floats[:pieces]:
        s.send(piece.astype("<f4").tobytes())
    wait_until(lambda: _metric(server.metrics_url, "cosyvoice_live_sessions", VC) == 1, "the session live on Triton")
    return s


def _direct_vc(server, rate, pieces) -> np.ndarray:
    with LiveClient(server.grpc_url, timeout=PATIENCE_S) as c:
        chunks = list(c.convert_live(pieces, sample_rate=rate, prompt=PROMPT.read_bytes(), encoded=True, seed=SEED))
    return np.concatenate([ch.waveform for ch in chunks])


def _direct_tts(server, texts) -> np.ndarray:
    with LiveClient(server.grpc_url, model=TTS, timeout=PATIENCE_S) as c:
        chunks = list(c.tts_live(texts, prompt=PROMPT.read_bytes(), encoded=True, prompt_text="A prompt.",
                                 seed=SEED))
    return np.concatenate([ch.waveform for ch in chunks])


def _ws_tts(gateway, key: str, texts) -> np.ndarray:
    s = Socket(gateway, TTS_LIVE_PATH, key)
    try:
        s.send(_tts_start())
        s.started()
        for t in texts:
            s.send({"type": "input.text", "text": t})
        s.send({"type": "input.end"})
        return np.frombuffer(b"".join(s.done()), "<f4")
    finally:
        s.close()


# ---------------------------------------------------------------------------------------------- the same audio


@pytest.mark.parametrize("fmt", ["f32le", "s16le"])
def test_vc_over_a_websocket_equals_a_direct_live_session(server, gateway, source, fmt):
    rate, ints, floats = source
    s = Socket(gateway, VC_LIVE_PATH)
    try:
        s.send(_vc_start(rate, fmt))
        info = s.started()
        assert info["model"] == VC and info["input"] == {"sample_rate": rate, "sample_format": fmt}
        for piece in (floats if fmt == "f32le" else ints):
            s.send(piece.astype("<f4" if fmt == "f32le" else "<i2").tobytes())
        s.send({"type": "input.end"})
        got = np.frombuffer(b"".join(s.done()), "<f4" if fmt == "f32le" else "<i2")
        done = s.events[-1]["stats"]
    finally:
        s.close()
    want = _direct_vc(server, rate, floats if fmt == "f32le" else ints)  # the library reads int16 as the gateway does
    assert done["pieces"] == len(ints) and done["audio_seconds"] > 4.5, done
    if fmt == "f32le":
        np.testing.assert_array_equal(got, want)
    else:
        assert got.shape == want.shape and np.abs(got.astype(np.int32) - pcm16(want)).max() <= 1
    _all_freed(server, gateway)


def test_tts_over_a_websocket_equals_a_direct_live_session(server, gateway):
    got = _ws_tts(gateway, KEY_A, TEXTS)
    want = _direct_tts(server, TEXTS)
    assert got.size and rel_err(got, want) < BAR
    _all_freed(server, gateway)


def test_the_socket_client_measures_what_the_grpc_client_measures(server, gateway, source):
    """:class:`LiveSocket` (the load tests' WebSocket side): the same audio as a direct session, each chunk charged
    to the input message it answers (the gateway's ``piece``), so its latency is measured as over gRPC."""
    from cosyvoice_triton.clients.live import LiveStats
    from cosyvoice_triton.clients.live_ws import LiveSocket

    rate, _, floats = source
    socket, stats = LiveSocket(f"http://{gateway.http}", key=KEY_A, timeout=PATIENCE_S, proxy=None), LiveStats()
    chunks = list(socket.convert_live(floats, sample_rate=rate, reference_audio=PROMPT.read_bytes(), seed=SEED,
                                      stats=stats))
    np.testing.assert_array_equal(np.concatenate([c.waveform for c in chunks]), _direct_vc(server, rate, floats))
    pieces = [c.piece for c in chunks]
    assert pieces == sorted(pieces) and pieces[0] >= 0 and pieces[-1] <= len(floats)  # len(floats): input.end
    assert all(c.latency_s >= 0 for c in chunks) and stats.chunks == len(chunks) and stats.pieces == len(floats)
    assert abs(stats.source_seconds - sum(len(f) for f in floats) / rate) < 1e-6 and stats.first_audio_s > 0
    spoken = list(socket.tts_live(TEXTS, reference_audio=PROMPT.read_bytes(), reference_text="A prompt.", seed=SEED))
    assert rel_err(np.concatenate([c.waveform for c in spoken]), _direct_tts(server, TEXTS)) < BAR
    assert all(0 <= c.piece <= len(TEXTS) for c in spoken)
    from cosyvoice_triton.clients.live_ws import LiveSpeechError

    with pytest.raises(LiveSpeechError) as refused:
        stranger = LiveSocket(f"http://{gateway.http}", key="sk-not-a-key", proxy=None)
        list(stranger.convert_live(floats[:1], sample_rate=rate, reference_audio=b"RIFF"))
    assert refused.value.code == "invalid_api_key"
    _all_freed(server, gateway)


# ---------------------------------------------------------------------------------------------- hostile


def test_a_wrong_rate_and_a_wrong_key_are_refused_at_the_start(server, gateway, source):
    s = Socket(gateway, VC_LIVE_PATH)
    s.send(_vc_start(1000))
    assert "1000" in s.refused("invalid_sample_rate")["message"]
    s = Socket(gateway, VC_LIVE_PATH, subprotocols=[SUBPROTOCOL, "bearer.sk-not-a-key"])
    s.refused("invalid_api_key")
    s = Socket(gateway, VC_LIVE_PATH, subprotocols=[SUBPROTOCOL, f"bearer.{KEY_B}"])  # a browser's key
    try:
        assert s.ws.subprotocol == SUBPROTOCOL
        s.send(_vc_start(source[0]))
        s.started()
    finally:
        s.close()
    _all_freed(server, gateway)


def test_an_oversized_frame_cuts_its_session_and_frees_it(server, gateway, source):
    s = _vc_live(server, gateway, source)
    s.send(np.zeros(int(5.5 * source[0]), "<f4").tobytes())
    assert "5.50 s" in s.refused("piece_too_large")["message"]
    _all_freed(server, gateway)


def test_a_tenant_over_its_share_is_refused_while_another_speaks_as_alone(server, gateway):
    alone = _direct_tts(server, TEXTS[:2])
    a = Socket(gateway, TTS_LIVE_PATH, KEY_A)
    try:
        a.send(_tts_start())
        a.started()
        a.send({"type": "input.text", "text": "Holding "})  # A's session live on Triton, its text still open
        wait_until(lambda: _metric(server.metrics_url, "cosyvoice_live_sessions", TTS) == 1, "A's session live")
        again = Socket(gateway, TTS_LIVE_PATH, KEY_A)
        again.send(_tts_start())
        assert "--live-sessions-per-tenant" in again.refused("too_many_sessions")["message"]
        b = _ws_tts(gateway, KEY_B, TEXTS[:2])  # B's own session, beside A's
        assert rel_err(b, alone) < BAR
        a.send({"type": "input.end"})
        a.done()
    finally:
        a.close()
    _all_freed(server, gateway)


def test_a_session_whose_input_stops_is_cut_at_the_idle_time(server, gateway, source):
    t0 = time.monotonic()
    s = _vc_live(server, gateway, source)
    assert f"within {IDLE_S:g} s" in s.refused("session_idle")["message"]
    assert IDLE_S <= time.monotonic() - t0 <= IDLE_S + PATIENCE_S
    _all_freed(server, gateway)


def test_a_client_that_vanishes_frees_its_session(server, gateway, source):
    s = _vc_live(server, gateway, source, pieces=3)
    gone = _metric(gateway.base + "/metrics", "cosyvoice_gateway_live_sessions_ended_total", VC, reason="client_gone")
    s.ws.close_socket()  # no close frame: the connection just ends
    _all_freed(server, gateway)
    assert _metric(gateway.base + "/metrics", "cosyvoice_gateway_live_sessions_ended_total", VC,
                   reason="client_gone") == gone + 1
