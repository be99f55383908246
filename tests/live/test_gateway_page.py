"""The gateway's listening page (GET /listen) in a real headless browser (the system's chromium, driven by
playwright) against the gateway process and a real tritonserver (test_gateway_live's fixtures): voices listed once
the key is entered, text to speech with a registered voice played as it streams and offered as a WAV equal to
Triton's own stream, a recorded prompt (chromium's fake microphone) used for zero-shot speech, and voice conversion
of an uploaded source into an uploaded prompt's voice. A screenshot goes to build/test-artifacts/."""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from conftest import FIXTURES, PATIENCE_S, PATIENT_TEST_S
from starlette.testclient import TestClient
from test_gateway_live import KEY, SEED, TEXT, VOICE, gateway, triton  # noqa: F401  (the shared fixtures)

CHROMIUM = Path("/usr/bin/chromium")
ARTIFACTS = Path(__file__).resolve().parents[2] / "build" / "test-artifacts"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        "--use-fake-device-for-media-stream", "--use-fake-ui-for-media-stream"]
WAIT_MS = PATIENCE_S * 1000


def test_page_routes_and_headers():
    from cosyvoice_triton.gateway import GatewayConfig, create_app
    from cosyvoice_triton.gateway.page import CSP

    with TestClient(create_app(GatewayConfig(api_keys=frozenset({KEY})), backend=object())) as c:
        r = c.get("/", follow_redirects=False)
        assert r.status_code == 307 and r.headers["location"] == "/listen"
        page = c.get("/listen")  # public: the key is the page's to send with the API calls
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert page.headers["content-security-policy"] == CSP and "'unsafe-inline'" not in CSP
        for name in ("listen.js", "live.js", "listen.css"):
            assert f'"/listen/{name}"' in page.text
            assert c.get(f"/listen/{name}").status_code == 200
        for name in ("nothing.js", "..%2Fpage.py", "static"):
            r = c.get(f"/listen/{name}")
            assert r.status_code == 404 and r.json()["error"]["message"]


@contextlib.contextmanager
def chromium(profile: Path, *args: str):
    """A headless chromium (its browser context) on ``profile``, with ``ARGS`` and ``args``; closed at the end.
    Skips without chromium or playwright."""
    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} is absent: apt-get install -y chromium (the page's browser test drives it)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed: pip install -e .[dev]")
    with sync_api.sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(str(profile), executable_path=str(CHROMIUM), headless=True,
                                                        args=[*ARGS, *args], accept_downloads=True)
        try:
            yield context
        finally:
            context.close()


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    with chromium(tmp_path_factory.mktemp("chromium-profile")) as context:
        yield context


def _run(page, button: str, what: str) -> dict:
    """Click ``button`` and wait until the request it starts has finished (or was refused by the page)."""
    runs = page.evaluate("() => listenState.runs")
    page.click(button)
    page.wait_for_function("n => listenState.runs > n && !listenState.busy && (listenState.done || listenState.error)",
                           arg=runs, timeout=WAIT_MS)
    state = page.evaluate("() => ({...listenState, prompt: null, source: null})")
    assert state["done"] and not state["error"], f"{what}: {state['error']}"
    return state


def _download(page, tmp_path, name: str) -> tuple[np.ndarray, int, int]:
    link = page.locator("#download")
    assert link.is_visible()
    with page.expect_download(timeout=WAIT_MS) as info:
        link.click()
    path = tmp_path / name
    info.value.save_as(path)
    wave, sr = sf.read(path, dtype="int16")
    return wave, sr, path.stat().st_size


def _played(page, state: dict) -> None:
    """The stream arrived in pieces and each was scheduled on the page's AudioContext, which is playing them."""
    assert state["received"] > 0 and state["chunks"] >= 1 and state["scheduled"] == state["chunks"]
    page.wait_for_function("() => audioCtx && audioCtx.state === 'running' && audioCtx.currentTime > 0",
                           timeout=WAIT_MS)


@pytest.mark.timeout(PATIENT_TEST_S)
def test_the_page_speaks_records_and_converts(browser, gateway, triton, tmp_path):  # noqa: F811
    from cosyvoice_triton.gateway.audio import pcm16

    url = gateway[0]
    page = browser.new_page()
    errors = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.goto(url + "/", wait_until="load")
    assert page.url == url + "/listen"
    # the gateway has a key: without it the voices are refused, and the page says so
    page.wait_for_function("() => listenState.voicesError !== ''", timeout=WAIT_MS)
    assert "401" in page.text_content("#voices-note")
    page.fill("#key", KEY)
    page.click("#refresh")
    page.wait_for_function(f"() => (listenState.voices || []).includes({VOICE!r})", timeout=WAIT_MS)
    assert VOICE in page.locator("#voice option").all_text_contents()

    # text to speech with the registered voice, streamed and played; the download is Triton's own stream
    want = pcm16(np.concatenate([c.waveform.reshape(-1) for c in triton.tts_stream(TEXT, speaker_id=VOICE,
                                                                                     seed=SEED)]))
    page.select_option("#voice", VOICE)
    page.fill("#text", TEXT)
    page.click("summary")
    page.fill("#seed", str(SEED))
    state = _run(page, "#speak", "speech")
    _played(page, state)
    wave, sr, size = _download(page, tmp_path, "speech.wav")
    assert sr == 24000 == state["sampleRate"] and size == 44 + 2 * len(want) == state["result"]["bytes"]
    np.testing.assert_array_equal(wave, want)

    # record a prompt with chromium's fake microphone (a beep), then speak zero-shot in its voice
    page.click("#prompt-record")
    page.wait_for_function("() => listenState.recording === 'prompt' && listenState.recordedS >= 2",
                           timeout=WAIT_MS)
    page.click("#prompt-record")
    page.wait_for_function("() => listenState.prompt !== null", timeout=WAIT_MS)
    prompt = page.evaluate("() => ({bytes: listenState.prompt.bytes, seconds: listenState.prompt.seconds})")
    assert prompt["seconds"] >= 1.5 and prompt["bytes"] == 44 + 2 * round(16000 * prompt["seconds"])
    assert page.is_checked("input[name=mode][value=prompt]")
    page.fill("#prompt-text", "a steady beep")
    state = _run(page, "#speak", "zero-shot speech from the recorded prompt")
    _played(page, state)
    wave, sr, _ = _download(page, tmp_path, "zero_shot.wav")
    assert sr == 24000 and len(wave) == state["result"]["samples"] > 0 and np.abs(wave).max() > 0

    # voice conversion of an uploaded source into the voice of an uploaded prompt (source_wav + prompt_wav)
    page.set_input_files("#prompt-file", str(FIXTURES / "prompt_en_3s.wav"))
    page.wait_for_function("() => listenState.prompt && listenState.prompt.origin === 'prompt_en_3s.wav'",
                           timeout=WAIT_MS)
    page.set_input_files("#source-file", str(FIXTURES / "source_en_5s.wav"))
    page.wait_for_function("() => listenState.source !== null", timeout=WAIT_MS)
    state = _run(page, "#convert", "voice conversion")
    _played(page, state)
    wave, sr, _ = _download(page, tmp_path, "converted.wav")
    assert sr == 24000 and len(wave) == state["result"]["samples"] > 0
    source_s = sf.info(str(FIXTURES / "source_en_5s.wav")).duration
    assert 0.5 * source_s < len(wave) / sr < 1.5 * source_s  # the source's length, in another voice
    assert not errors, errors

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shot = ARTIFACTS / "gateway_page.png"
    page.set_viewport_size({"width": 1000, "height": 1400})
    page.screenshot(path=str(shot), full_page=True)
    print(f"screenshot: {shot}")
    shutil.copy(tmp_path / "converted.wav", ARTIFACTS / "gateway_page_converted.wav")
    page.close()
