"""The listening page's live sessions in a real headless chromium against a real gateway (a key, a voice of its
tenant) in front of a real tritonserver with both live models (tiny demo model):

* "talk and hear": chromium's fake microphone plays a fixture WAV; the page sends it as float32 frames at its
  capture rate over ``/v1/audio/voice-conversion/live`` and plays the converted chunks as they arrive. The first
  audio arrives while the page is still sending, and the audio the page received equals, bit for bit, what a
  direct WebSocket client gets for the frames the page sent (recorded by the page in ``window.__live``, replayed at
  real time), the same bar as the served WebSocket test's float32 sessions;
* "type and hear": a text typed into the page goes out word by word as ``input.text`` over
  ``/v1/audio/speech/live``; the page's audio equals a direct client's for the same pieces (rel 1e-3);
* a wrong key: the gateway's error is shown on the page.

What the fake microphone captures depends on when chromium starts reading its file, so the test compares the page
with a replay of what the page sent, not with the file."""

from __future__ import annotations

import base64
import time

import numpy as np
import pytest
import soundfile as sf
from conftest import FIXTURES, PATIENCE_S, PATIENT_TEST_S, gateway_process, rel_err
from test_gateway_live_ws_served import BAR, Socket, server  # noqa: F401  (both live models served)
from test_gateway_page import ARTIFACTS, WAIT_MS, chromium

from cosyvoice_triton.gateway.live_ws import TTS_LIVE_PATH, VC_LIVE_PATH

pytestmark = pytest.mark.timeout(PATIENT_TEST_S)

KEY = "sk-page-live"
VOICE = "page_voice"
SEED = 7
TYPED = "Hello there, this is the page speaking live."
TALK_S = 3.0  # seconds of microphone audio the page sends before Stop

# the page's record, its byte arrays as base64
DUMP = """() => {
  const b64 = (u8) => { let s = ""; for (let i = 0; i < u8.length; i += 0x8000) {
    s += String.fromCharCode(...u8.subarray(i, i + 0x8000)); } return btoa(s); };
  const l = window.__live;
  return { mode: l.mode, done: l.done, error: l.error, rate: l.rate, firstAudioMs: l.firstAudioMs,
           sentAt: l.sentAt, receivedAt: l.receivedAt, endedAt: l.endedAt, latencies: l.latencies,
           sent: l.sent.map((p) => typeof p === "string" ? p : b64(new Uint8Array(p.buffer))),
           received: l.received.map(b64) };
}"""


@pytest.fixture(scope="module")
def gateway(server, tmp_path_factory):  # noqa: F811
    """The gateway with KEY, VOICE registered in KEY's tenant (on Triton, as the gateway's registration stores it)."""
    from cosyvoice_triton.clients.client import VCClient
    from cosyvoice_triton.gateway.tenants import Namespace, key_tenant

    folder = tmp_path_factory.mktemp("page_live_gateway")
    with VCClient(server.grpc_url, protocol="grpc", timeout=PATIENCE_S) as c, \
            gateway_process(server, folder / "gateway.log", "--api-key", KEY) as urls:
        c.register_speaker(Namespace(key_tenant(KEY)).scoped(VOICE), str(FIXTURES / "prompt_en_3s.wav"),
                           prompt_text="A prompt.")
        yield urls


@pytest.fixture(scope="module")
def microphone(tmp_path_factory):
    """The fixture source as chromium's fake capture file reads it: a RIFF WAV of 16-bit PCM (it loops it)."""
    pcm, rate = sf.read(FIXTURES / "source_en_5s.wav", dtype="int16")
    path = tmp_path_factory.mktemp("microphone") / "source.wav"
    sf.write(path, pcm, rate, subtype="PCM_16", format="WAV")
    return path


@pytest.fixture(scope="module")
def page(gateway, microphone, tmp_path_factory):
    with chromium(tmp_path_factory.mktemp("chromium-live"), f"--use-file-for-fake-audio-capture={microphone}") as ctx:
        page = ctx.new_page()
        errors = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        page.goto(gateway.base + "/listen", wait_until="load")
        page.fill("#key", KEY)
        page.click("#refresh")
        page.wait_for_function(f"() => (listenState.voices || []).includes({VOICE!r})", timeout=WAIT_MS)
        page.select_option("#voice", VOICE)
        page.click("summary")
        page.fill("#seed", str(SEED))
        yield page
        assert not errors, errors


def _finish(page, end: str) -> dict:
    """Click ``end`` (Stop, End); the page's record once the gateway has closed the session."""
    page.click(end)
    page.wait_for_function("() => !window.__live.running", timeout=WAIT_MS)
    record = page.evaluate(DUMP)
    assert record["done"] and not record["error"], record["error"]
    assert page.text_content("#live-status").startswith("done")
    return record


def _replay(gateway, path: str, start: dict, pieces, pace_s: float = 0.0) -> bytes:
    """What a direct WebSocket client gets for ``pieces`` (bytes: frames, str: text), ``pace_s`` apart."""
    s = Socket(gateway, path, KEY)
    try:
        s.send({"type": "session.start", "voice": VOICE, "seed": SEED, "output_format": "f32le", **start})
        s.started()
        for piece in pieces:
            s.send({"type": "input.text", "text": piece} if isinstance(piece, str) else piece)
            time.sleep(pace_s)
        s.send({"type": "input.end"})
        return b"".join(s.done())
    finally:
        s.close()


def test_talk_and_hear_equals_a_direct_session_for_the_frames_the_page_sent(page, gateway):
    page.click("#talk")
    page.wait_for_function(f"() => window.__live.received.length > 0 && window.__live.sentAt.length * 2048 >= "
                           f"{TALK_S} * window.__live.rate", timeout=WAIT_MS)
    record = _finish(page, "#talk-stop")
    assert record["mode"] == "talk" and record["rate"] >= 8000
    frames = [base64.b64decode(f) for f in record["sent"]]
    source = np.frombuffer(b"".join(frames), "<f4")
    assert len(source) >= TALK_S * record["rate"] and np.abs(source).max() > 0.01  # the fake microphone's audio
    got = b"".join(base64.b64decode(c) for c in record["received"])
    assert len(got) > 0 and len(got) % 4 == 0
    # the first audio came while the page was still sending: before its last frame and its input.end
    assert record["receivedAt"][0] < record["sentAt"][-1] < record["endedAt"]
    assert 0 < record["firstAudioMs"] < (record["endedAt"] - record["sentAt"][0])
    assert len(record["latencies"]) == len(record["received"])
    assert "first audio" in page.text_content("#live-latency")

    want = _replay(gateway, VC_LIVE_PATH, {"sample_rate": record["rate"], "sample_format": "f32le"}, frames,
                   pace_s=len(source) / record["rate"] / len(frames))
    np.testing.assert_array_equal(np.frombuffer(got, "<f4"), np.frombuffer(want, "<f4"))
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "gateway_page_live.png"), full_page=True)
    print(f"talk and hear: {len(frames)} frames at {record['rate']} Hz ({len(source) / record['rate']:.2f} s), "
          f"{len(record['received'])} chunks ({len(got) / 4 / 24000:.2f} s), first audio "
          f"{record['firstAudioMs']:.0f} ms, median latency {np.median(record['latencies']):.0f} ms; screenshot "
          f"{ARTIFACTS / 'gateway_page_live.png'}")


def test_type_and_hear_equals_a_direct_session_for_the_words_typed(page, gateway):
    page.click("#type")
    page.wait_for_function("() => !document.getElementById('live-text').disabled && "
                           "document.getElementById('live-status').textContent.startsWith('type:')", timeout=WAIT_MS)
    page.type("#live-text", TYPED, delay=20)
    record = _finish(page, "#type-end")
    words = TYPED.split(" ")
    assert record["sent"] == [w + " " for w in words[:-1]] + [words[-1]]  # each word as its space was typed
    got = np.frombuffer(b"".join(base64.b64decode(c) for c in record["received"]), "<f4")
    want = np.frombuffer(_replay(gateway, TTS_LIVE_PATH, {}, record["sent"]), "<f4")
    assert got.size and rel_err(got, want) < BAR


def test_the_gateway_s_error_is_shown(page):
    page.evaluate("() => { document.getElementById('key').value = 'sk-not-a-key'; }")  # no change event: voices kept
    try:
        page.click("#type")
        page.wait_for_function("() => !window.__live.running", timeout=WAIT_MS)
        error = page.evaluate("() => window.__live.error")
        assert error.startswith("invalid_api_key:"), error
        assert page.text_content("#live-status") == error
        assert page.get_attribute("#live-status", "class") == "error"
    finally:
        page.fill("#key", KEY)
