"""Live sessions over WebSocket at the gateway (``/v1/audio/voice-conversion/live``, ``/v1/audio/speech/live``,
:mod:`cosyvoice_triton.gateway.live_ws`), in process: the real app under Starlette's test client, a stand-in of
the upstream live client (:class:`FakeLive`, ``convert_live`` / ``tts_live`` as ``AsyncLiveClient`` has them: one
chunk per piece) that records what each session got and how it ended. The protocol, the keys (header and
subprotocol), the tenant's share and the key's limits, every error event with its code and close code, the bounded
queue of pieces, idle sessions cut, and a client that leaves freeing its session. Against a real tritonserver (the
audio equal to a direct gRPC live session): ``tests/live/test_gateway_live_ws_served.py``."""

from __future__ import annotations

import asyncio
import base64
import json
import time

import numpy as np
import pytest
from standin_gateway import Backend
from starlette.testclient import TestClient
from starlette.websockets import WebSocketDisconnect

from cosyvoice_triton.clients.live import LiveChunk
from cosyvoice_triton.clients.wire import VCError
from cosyvoice_triton.gateway import GatewayConfig, create_app
from cosyvoice_triton.gateway.live_ws import ERRORS, SUBPROTOCOL, TTS_LIVE_PATH, VC_LIVE_PATH

KEY_A, KEY_B = "sk-live-a", "sk-live-b"
TENANTS = (("sk-live-a", "tenant_a"), ("sk-live-b", "tenant_b"))
RATE = 16000
VC_START = {"type": "session.start", "voice": "alice", "sample_rate": RATE, "sample_format": "s16le",
            "output_format": "f32le", "seed": 3}
TTS_START = {"type": "session.start", "voice": "alice"}


class FakeLive:
    """The upstream: each piece becomes one chunk at once (``delay``: after so long); ``refuse``: the session's
    first answer is this error instead. ``sessions``: what each got (kind, its arguments, its pieces) and how it
    ended (``"ended"``: its pieces ran out, ``"closed"``: closed before)."""

    def __init__(self, delay: float = 0.0, refuse: VCError | None = None):
        self.delay, self.refuse, self.sessions = delay, refuse, []

    async def _run(self, kind, pieces, kw):
        rec = {"kind": kind, "kw": kw, "pieces": [], "state": "open"}
        self.sessions.append(rec)
        stats, t0 = kw["stats"], time.perf_counter()
        try:
            async for piece in pieces:
                if self.refuse is not None:
                    raise self.refuse
                rec["pieces"].append(piece)
                stats.pieces += 1
                await asyncio.sleep(self.delay)
                wave = (np.asarray(piece, np.float32) / 32768.0 if kind == "vc"
                        else np.full(10 * len(piece), len(piece) / 100.0, np.float32))
                now = time.perf_counter()
                chunk = LiveChunk(wave, 24000, len(rec["pieces"]) - 1, now - t0, piece=len(rec["pieces"]) - 1,
                                  latency_s=0.01)
                stats.add(chunk, now)
                yield chunk
            rec["state"] = "ended"
        finally:
            if rec["state"] == "open":
                rec["state"] = "closed"

    def convert_live(self, pieces, **kw):
        return self._run("vc", pieces, kw)

    def tts_live(self, pieces, **kw):
        return self._run("tts", pieces, kw)


def _app(live=None, keys=True, **cfg):
    config = GatewayConfig(api_keys=frozenset(k for k, _ in TENANTS) if keys else frozenset(),
                           tenants=TENANTS if keys else (), **cfg)
    app = create_app(config, Backend(), live=live or FakeLive())
    return TestClient(app), app


def _auth(key=KEY_A):
    return {"headers": {"authorization": f"Bearer {key}"}}


def _events_until_close(ws) -> tuple[list, list, int]:
    """(JSON events, binary frames, close code) up to the server's close."""
    events, frames = [], []
    while True:
        message = ws.receive()
        if message["type"] == "websocket.close":
            return events, frames, message["code"]
        if message.get("bytes") is not None:
            frames.append(message["bytes"])
        else:
            events.append(json.loads(message["text"]))


def _refused(ws, code: str) -> dict:
    """The error event and the close that must follow it."""
    events, _, close = _events_until_close(ws)
    errors = [e for e in events if e["type"] == "error"]
    assert len(errors) == 1, events
    err = errors[0]["error"]
    assert err["code"] == code and err["message"] and set(err) == {"message", "type", "param", "code"}, err
    assert close == ERRORS[code][1], (close, code)
    return err


def _started(ws) -> dict:
    event = ws.receive_json()
    assert event["type"] == "session.started", event
    return event["session"]


def _metric(app, name, **labels) -> float:
    value = app.state.metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def _pcm(n: int, seed: int = 0) -> np.ndarray:
    return (np.random.default_rng(seed).uniform(-0.5, 0.5, n) * 32767).astype("<i2")


# ---------------------------------------------------------------------------------------------- sessions


def test_vc_session_converts_binary_pieces_and_ends_cleanly():
    live = FakeLive()
    client, app = _app(live)
    pieces = [_pcm(3200, k) for k in range(3)]
    with client, client.websocket_connect(VC_LIVE_PATH, **_auth()) as ws:
        ws.send_json(VC_START)
        info = _started(ws)
        assert info["model"] == "cosyvoice_vc_live" and info["sample_rate"] == 24000
        assert info["input"] == {"sample_rate": RATE, "sample_format": "s16le"} and info["output_format"] == "f32le"
        for p in pieces:
            ws.send_bytes(p.tobytes())
        ws.send_json({"type": "input.end"})
        events, frames, close = _events_until_close(ws)
    assert close == 1000 and [e["type"] for e in events] == ["speech.audio.done"], events
    assert events[0]["stats"]["pieces"] == 3 and events[0]["stats"]["chunks"] == 3
    got = np.concatenate([np.frombuffer(f, "<f4") for f in frames])
    np.testing.assert_array_equal(got, np.concatenate(pieces).astype(np.float32) / 32768.0)
    (rec,) = live.sessions
    assert rec["state"] == "ended" and [p.dtype for p in rec["pieces"]] == [np.dtype("<i2")] * 3
    kw = rec["kw"]
    assert kw["sample_rate"] == RATE and kw["speaker_id"] == "t-tenant_a.alice" and kw["seed"] == 3
    assert 2**32 <= kw["sequence_id"] < 2**63  # drawn by the gateway, not the client's
    assert _metric(app, "cosyvoice_gateway_live_sessions", model="cosyvoice_vc_live") == 0
    assert _metric(app, "cosyvoice_gateway_live_sessions_ended_total", model="cosyvoice_vc_live",
                   reason="done") == 1
    assert _metric(app, "cosyvoice_gateway_live_chunk_latency_seconds_count", model="cosyvoice_vc_live") == 3
    assert _metric(app, "cosyvoice_gateway_live_first_audio_seconds_count", model="cosyvoice_vc_live") == 1
    assert _metric(app, "cosyvoice_gateway_sequences") == 0


def test_short_frames_are_gathered_into_pieces_by_their_samples_alone():
    live = FakeLive()
    client, _ = _app(live)
    frames = [_pcm(320, k) for k in range(10)] + [_pcm(100, 10)]  # 20 ms frames (a browser's), then a short tail
    with client, client.websocket_connect(VC_LIVE_PATH, **_auth()) as ws:
        ws.send_json(VC_START)
        assert _started(ws)["min_piece_ms"] == 100
        for f in frames:
            ws.send_bytes(f.tobytes())
        ws.send_json({"type": "input.end"})
        _, out, close = _events_until_close(ws)
    assert close == 1000
    assert [len(p) for p in live.sessions[0]["pieces"]] == [1600, 1600, 100]  # 100 ms at 16 kHz, the rest at the end
    np.testing.assert_array_equal(np.concatenate([np.frombuffer(f, "<f4") for f in out]),
                                  np.concatenate(frames).astype(np.float32) / 32768.0)


def test_a_gathered_piece_never_passes_the_longest():
    from cosyvoice_triton.gateway.live_ws import _Gather

    g = _Gather(least=2400, most=3200)
    a, b, c = np.zeros(1000), np.ones(3000), np.full(2500, 2.0)
    assert g.add(a, 0) == []
    (first, i), (second, j) = g.add(b, 1)  # 1000 + 3000 would pass 3200: the 1000 go on first, then the 3000 alone
    assert len(first) == 1000 and len(second) == 3000 and g.flush(2) == []
    assert (i, j) == (0, 1)  # each charged to the message of its last frame
    ((alone, k),) = g.add(c, 2)
    assert alone is c and k == 2
    assert g.add(a, 3) == [] and [(len(p), k) for p, k in g.flush(4)] == [(1000, 4)]  # the rest: to the end
    assert [len(x) for x, _ in _Gather(0, 10).add(np.zeros(3))] == [3]  # no gathering


def test_tts_session_speaks_text_deltas_as_audio_delta_events():
    live = FakeLive()
    client, _ = _app(live)
    texts = ["Hello ", "", "there, ", "friend."]
    with client, client.websocket_connect(TTS_LIVE_PATH, **_auth()) as ws:
        ws.send_json({"type": "session.start", "stream_format": "events",
                      "reference_audio": base64.b64encode(b"RIFF").decode(), "reference_text": "A prompt."})
        assert _started(ws)["model"] == "cosyvoice_tts_live"
        for t in texts:
            ws.send_json({"type": "input.text", "text": t})
        ws.send_json({"type": "input.end"})
        events, frames, close = _events_until_close(ws)
    assert close == 1000 and not frames
    deltas = [e for e in events if e["type"] == "speech.audio.delta"]
    assert [e["type"] for e in events] == ["speech.audio.delta"] * 3 + ["speech.audio.done"]
    got = [np.frombuffer(base64.b64decode(e["audio"]), "<i2") for e in deltas]
    assert [len(g) for g in got] == [10 * len(t) for t in texts if t]  # s16le by default; the empty piece not sent
    assert [e["piece"] for e in deltas] == [0, 2, 3]  # the input message each answers (the empty one skipped)
    (rec,) = live.sessions
    assert rec["pieces"] == [t for t in texts if t] and rec["kw"]["prompt"] == b"RIFF"
    assert rec["kw"]["encoded"] is True and rec["kw"]["prompt_text"] == "A prompt."


@pytest.mark.parametrize(("model", "upstream"), [(None, "cosyvoice_tts_live"), ("tts-1", "cosyvoice_tts_live"),
                                               ("cosyvoice3", "cosyvoice3_tts_live")])
def test_the_start_s_model_picks_the_live_tts_family(model, upstream):
    """``model`` as in ``POST /v1/audio/speech``: ``cosyvoice3`` (served: in ``--models``) speaks through CosyVoice3's
    live model, OpenAI's names and none through CosyVoice2's; the session's id, share and metrics are that model's."""
    live = FakeLive()
    client, app = _app(live, models=("cosyvoice2", "cosyvoice3", "tts-1"))
    start = {**TTS_START, **({} if model is None else {"model": model})}
    with client, client.websocket_connect(TTS_LIVE_PATH, **_auth()) as ws:
        ws.send_json(start)
        assert _started(ws)["model"] == upstream
        ws.send_json({"type": "input.text", "text": "Hello."})
        ws.send_json({"type": "input.end"})
        _, frames, close = _events_until_close(ws)
    assert close == 1000 and frames
    (rec,) = live.sessions
    assert rec["kw"]["model"] == upstream and rec["state"] == "ended"
    assert _metric(app, "cosyvoice_gateway_live_sessions_ended_total", model=upstream, reason="done") == 1


@pytest.mark.parametrize(("model", "upstream"), [(None, "cosyvoice_vc_live"), ("cosyvoice2", "cosyvoice_vc_live"),
                                               ("cosyvoice3", "cosyvoice3_vc_live")])
def test_the_start_s_model_picks_the_live_vc_family(model, upstream):
    """Voice conversion's start takes ``model`` too: ``cosyvoice3`` converts through CosyVoice3's live model (without
    a seed: CosyVoice3 has nothing to seed), the others and none through CosyVoice2's."""
    live = FakeLive()
    client, app = _app(live, models=("cosyvoice2", "cosyvoice3"))
    start = {**VC_START, **({} if model is None else {"model": model})}
    if model == "cosyvoice3":
        del start["seed"]
    with client, client.websocket_connect(VC_LIVE_PATH, **_auth()) as ws:
        ws.send_json(start)
        assert _started(ws)["model"] == upstream
        ws.send_bytes(_pcm(3200, 0).tobytes())
        ws.send_json({"type": "input.end"})
        _, frames, close = _events_until_close(ws)
    assert close == 1000 and frames
    (rec,) = live.sessions
    assert rec["kw"]["model"] == upstream and rec["state"] == "ended"
    assert _metric(app, "cosyvoice_gateway_live_sessions_ended_total", model=upstream, reason="done") == 1


@pytest.mark.parametrize("case", ["seed", "not_served"])
def test_a_cosyvoice3_vc_start_with_a_seed_or_unserved_is_refused(case):
    live = FakeLive()
    client, _ = _app(live, models=("cosyvoice2", "cosyvoice3") if case == "seed" else ("cosyvoice2",))
    with client, client.websocket_connect(VC_LIVE_PATH, **_auth()) as ws:
        ws.send_json({**VC_START, "model": "cosyvoice3"})
        err = _refused(ws, "invalid_start")
    assert err["param"] == ("seed" if case == "seed" else "model") and not live.sessions


def test_without_keys_the_voice_is_public_and_the_id_random():
    live = FakeLive()
    client, _ = _app(live, keys=False)
    with client, client.websocket_connect(TTS_LIVE_PATH) as ws:
        ws.send_json(TTS_START)
        _started(ws)
        ws.send_json({"type": "input.text", "text": "Hi."})
        ws.send_json({"type": "input.end"})
        assert _events_until_close(ws)[2] == 1000
    assert live.sessions[0]["kw"]["speaker_id"] == "alice"


# ---------------------------------------------------------------------------------------------- keys, limits


def test_a_browser_sends_its_key_as_a_subprotocol():
    client, _ = _app()
    with client, client.websocket_connect(TTS_LIVE_PATH, subprotocols=[SUBPROTOCOL, f"bearer.{KEY_B}"]) as ws:
        assert ws.accepted_subprotocol == SUBPROTOCOL
        ws.send_json(TTS_START)
        _started(ws)


@pytest.mark.parametrize("how", [{}, {"headers": {"authorization": "Bearer sk-wrong"}},
                                 {"subprotocols": [SUBPROTOCOL, "bearer.sk-wrong"]}], ids=["none", "header", "proto"])
def test_a_missing_or_wrong_key_is_refused(how):
    live = FakeLive()
    client, _ = _app(live)
    with client, client.websocket_connect(VC_LIVE_PATH, **how) as ws:
        _refused(ws, "invalid_api_key")
    assert not live.sessions


def test_the_tenants_share_of_a_live_model_refuses_at_once_and_frees_on_close():
    client, app = _app(live_sessions_per_tenant=(("cosyvoice_tts_live", 1),))
    with client:
        with client.websocket_connect(TTS_LIVE_PATH, **_auth()) as first:
            first.send_json(TTS_START)
            _started(first)
            with client.websocket_connect(TTS_LIVE_PATH, **_auth()) as second:
                second.send_json(TTS_START)
                err = _refused(second, "too_many_sessions")
                assert "--live-sessions-per-tenant" in err["message"]
            with client.websocket_connect(TTS_LIVE_PATH, **_auth(KEY_B)) as other:  # another tenant: its own share
                other.send_json(TTS_START)
                _started(other)
        with client.websocket_connect(TTS_LIVE_PATH, **_auth()) as again:  # A's first has gone: room again
            again.send_json(TTS_START)
            _started(again)
    assert _metric(app, "cosyvoice_gateway_sequences") == 0


def test_a_session_holds_one_of_its_keys_concurrent_requests():
    client, _ = _app(max_concurrency_per_key=1)
    with client, client.websocket_connect(VC_LIVE_PATH, **_auth()) as first:
        first.send_json(VC_START)
        _started(first)
        with client.websocket_connect(VC_LIVE_PATH, **_auth()) as second:
            _refused(second, "concurrency_limit_exceeded")
        r = client.get("/v1/audio/voices", **_auth())
        assert r.status_code == 429 and r.json()["error"]["code"] == "concurrency_limit_exceeded"


def test_a_session_start_counts_against_its_keys_rate():
    client, _ = _app(rate_limit="1/minute")
    with client:
        with client.websocket_connect(TTS_LIVE_PATH, **_auth()) as first:
            first.send_json(TTS_START)
            _started(first)
        with client.websocket_connect(TTS_LIVE_PATH, **_auth()) as second:
            assert "1 per 1 minute" in _refused(second, "rate_limit_exceeded")["message"]
        with client.websocket_connect(TTS_LIVE_PATH, **_auth(KEY_B)) as other:  # another key: its own window
            other.send_json(TTS_START)
            _started(other)


# ---------------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize(("path", "start", "code"), [
    (VC_LIVE_PATH, {**VC_START, "sample_rate": 1000}, "invalid_sample_rate"),
    (VC_LIVE_PATH, {**VC_START, "sample_rate": "fast"}, "invalid_sample_rate"),
    (VC_LIVE_PATH, {k: v for k, v in VC_START.items() if k != "sample_rate"}, "invalid_sample_rate"),
    (VC_LIVE_PATH, {**VC_START, "sample_format": "mp3"}, "invalid_start"),
    (VC_LIVE_PATH, {**VC_START, "reference_text": "x"}, "invalid_start"),
    (VC_LIVE_PATH, {**VC_START, "voice": None}, "invalid_start"),
    (TTS_LIVE_PATH, {**TTS_START, "reference_audio": "%%%"}, "invalid_start"),
    (TTS_LIVE_PATH, {**TTS_START, "voice": "../x"}, "invalid_start"),
    (TTS_LIVE_PATH, {**TTS_START, "reference_text": "x"}, "invalid_start"),
    (TTS_LIVE_PATH, {"type": "input.text", "text": "Hi"}, "missing_start"),
    (TTS_LIVE_PATH, [1, 2], "invalid_message"),
    (TTS_LIVE_PATH, {**TTS_START, "model": "cosyvoice3"}, "invalid_start"),  # not in this gateway's --models
    (TTS_LIVE_PATH, {**TTS_START, "model": "tts-9"}, "invalid_start"),
    (VC_LIVE_PATH, {**VC_START, "model": "tts-9"}, "invalid_start"),  # not one of this gateway's --models
], ids=["rate-low", "rate-text", "rate-missing", "format", "vc-text", "no-voice", "base64", "voice-id",
        "text-without-audio", "text-first", "not-object", "model-not-served", "model-unknown", "vc-model"])
def test_a_bad_start_is_refused_naming_it_and_nothing_goes_upstream(path, start, code):
    live = FakeLive()
    client, app = _app(live)
    with client, client.websocket_connect(path, **_auth()) as ws:
        ws.send_text(json.dumps(start))
        _refused(ws, code)
    assert not live.sessions and _metric(app, "cosyvoice_gateway_sequences") == 0


def test_a_binary_frame_before_the_start_is_refused():
    client, _ = _app()
    with client, client.websocket_connect(VC_LIVE_PATH, **_auth()) as ws:
        ws.send_bytes(_pcm(100).tobytes())
        _refused(ws, "missing_start")


@pytest.mark.parametrize(("path", "send", "code"), [
    (VC_LIVE_PATH, lambda ws: ws.send_bytes(_pcm(int(5.5 * RATE)).tobytes()), "piece_too_large"),
    (VC_LIVE_PATH, lambda ws: ws.send_bytes(b"\0\0\0"), "invalid_frame"),
    (VC_LIVE_PATH, lambda ws: ws.send_text("UklGRg=="), "binary_expected"),
    (VC_LIVE_PATH, lambda ws: ws.send_json({"type": "input.text", "text": "x"}), "binary_expected"),
    (TTS_LIVE_PATH, lambda ws: ws.send_bytes(b"Hello"), "text_expected"),
    (TTS_LIVE_PATH, lambda ws: ws.send_text("{not json"), "invalid_message"),
    (TTS_LIVE_PATH, lambda ws: ws.send_json({"type": "input.audio"}), "invalid_message"),
    (TTS_LIVE_PATH, lambda ws: ws.send_json({"type": "input.text", "text": "x" * 5000}), "piece_too_large"),
    (TTS_LIVE_PATH, lambda ws: ws.send_json({"type": "input.text", "text": 5}), "invalid_message"),
], ids=["vc-too-long", "vc-half-sample", "vc-text-frame", "vc-input-text", "tts-binary", "tts-bad-json",
        "tts-unknown-type", "tts-too-long", "tts-not-text"])
def test_a_bad_piece_cuts_its_session_and_frees_it_while_another_goes_on(path, send, code):
    live = FakeLive()
    client, app = _app(live)
    start = VC_START if path == VC_LIVE_PATH else TTS_START
    with client, client.websocket_connect(TTS_LIVE_PATH, **_auth(KEY_B)) as other:
        other.send_json(TTS_START)
        _started(other)
        with client.websocket_connect(path, **_auth()) as ws:
            ws.send_json(start)
            _started(ws)
            send(ws)
            _refused(ws, code)
        other.send_json({"type": "input.text", "text": "Still here."})
        other.send_json({"type": "input.end"})
        events, frames, close = _events_until_close(other)
        assert close == 1000 and len(frames) == 1 and events[-1]["type"] == "speech.audio.done"
    assert live.sessions[1]["state"] == "closed" and live.sessions[0]["state"] == "ended"
    assert _metric(app, "cosyvoice_gateway_sequences") == 0
    model = "cosyvoice_vc_live" if path == VC_LIVE_PATH else "cosyvoice_tts_live"
    assert _metric(app, "cosyvoice_gateway_live_sessions_ended_total", model=model, reason=code) == 1


@pytest.mark.parametrize(("status", "code"), [("StatusCode.UNAVAILABLE", "capacity"),
                                              ("StatusCode.INVALID_ARGUMENT", "invalid_input"),
                                              ("StatusCode.INTERNAL", "backend_error")])
def test_the_live_models_refusal_is_an_error_event_by_its_grpc_code(status, code):
    live = FakeLive(refuse=VCError("cosyvoice_vc_live: too many live sessions (4)", status))
    client, app = _app(live)
    with client, client.websocket_connect(VC_LIVE_PATH, **_auth()) as ws:
        ws.send_json(VC_START)
        _started(ws)
        ws.send_bytes(_pcm(1600).tobytes())
        err = _refused(ws, code)
    assert "too many live sessions" in err["message"]
    assert _metric(app, "cosyvoice_gateway_live_sessions", model="cosyvoice_vc_live") == 0


# ---------------------------------------------------------------------------------------------- bounds, loss


def test_more_pending_pieces_than_the_bound_cut_the_session():
    live = FakeLive(delay=0.5)  # the upstream falls behind
    client, app = _app(live, live_max_pending=2)
    with client, client.websocket_connect(VC_LIVE_PATH, **_auth()) as ws:
        ws.send_json(VC_START)
        _started(ws)
        for k in range(8):
            ws.send_bytes(_pcm(1600, k).tobytes())
        err = _refused(ws, "input_overrun")
    assert "2 pieces" in err["message"]
    assert len(live.sessions[0]["pieces"]) <= 4 and live.sessions[0]["state"] == "closed"
    assert _metric(app, "cosyvoice_gateway_live_sessions", model="cosyvoice_vc_live") == 0


@pytest.mark.parametrize("when", ["before-start", "after-a-piece"])
def test_an_idle_session_is_cut(when):
    live = FakeLive()
    client, app = _app(live, live_idle_s=0.3, header_timeout_s=0.3)
    with client, client.websocket_connect(VC_LIVE_PATH, **_auth()) as ws:
        if when == "after-a-piece":
            ws.send_json(VC_START)
            _started(ws)
            ws.send_bytes(_pcm(1600).tobytes())
        t0 = time.perf_counter()
        err = _refused(ws, "session_idle")
        assert time.perf_counter() - t0 < 5.0
    assert ("session.start" in err["message"]) == (when == "before-start")
    assert [s["state"] for s in live.sessions] == ([] if when == "before-start" else ["closed"])
    assert _metric(app, "cosyvoice_gateway_sequences") == 0


def test_a_client_that_leaves_frees_its_session_upstream_and_here():
    live = FakeLive()
    client, app = _app(live)
    with client:
        with client.websocket_connect(VC_LIVE_PATH, **_auth()) as ws:
            ws.send_json(VC_START)
            _started(ws)
            ws.send_bytes(_pcm(1600).tobytes())
            ws.receive_bytes()
            assert _metric(app, "cosyvoice_gateway_live_sessions", model="cosyvoice_vc_live") == 1
            assert _metric(app, "cosyvoice_gateway_sequences") == 1
            ws.close(1001)  # the socket closes without input.end (the test client then cancels the handler)
            deadline = time.monotonic() + 30
            while not _metric(app, "cosyvoice_gateway_live_sessions_ended_total", model="cosyvoice_vc_live",
                              reason="client_gone") and time.monotonic() < deadline:
                time.sleep(0.02)
        assert live.sessions[0]["state"] == "closed"
        assert _metric(app, "cosyvoice_gateway_live_sessions_ended_total", model="cosyvoice_vc_live",
                       reason="client_gone") == 1
        assert _metric(app, "cosyvoice_gateway_live_sessions", model="cosyvoice_vc_live") == 0
        assert _metric(app, "cosyvoice_gateway_sequences") == 0
        r = client.get("/v1/audio/voices", **_auth())  # the key's slot is back too
        assert r.status_code == 200


def test_a_piece_after_input_end_is_refused():
    live = FakeLive(delay=0.3)
    client, _ = _app(live)
    with client, client.websocket_connect(TTS_LIVE_PATH, **_auth()) as ws:
        ws.send_json(TTS_START)
        _started(ws)
        ws.send_json({"type": "input.text", "text": "Hi."})
        ws.send_json({"type": "input.end"})
        ws.send_json({"type": "input.text", "text": "More."})
        _refused(ws, "input_ended")


def test_the_websocket_routes_are_not_http_routes():
    client, _ = _app()
    with client:
        assert client.get(VC_LIVE_PATH, **_auth()).status_code in (404, 405)
        with pytest.raises(WebSocketDisconnect), client.websocket_connect("/v1/audio/live-nothing", **_auth()) as ws:
            ws.receive_json()
