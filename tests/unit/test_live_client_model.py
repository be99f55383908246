"""Which live model a live client's session runs on (``clients.live.session_model``): the one given, else the
client's own unless it names the other kind's live model, else the kind's default; a client made for CosyVoice3
live TTS speaks CosyVoice3 without repeating the model."""

from __future__ import annotations

import pytest

from cosyvoice_triton.clients.live import LiveClient, session_model


@pytest.mark.parametrize(("kind", "given", "own", "want"), [
    ("tts", None, "cosyvoice_vc_live", "cosyvoice_tts_live"),  # the default client (VC) speaks CosyVoice2
    ("tts", None, "cosyvoice3_tts_live", "cosyvoice3_tts_live"),
    ("tts", None, "cosyvoice3_vc_live", "cosyvoice_tts_live"),
    ("vc", None, "cosyvoice_vc_live", "cosyvoice_vc_live"),
    ("vc", None, "cosyvoice3_vc_live", "cosyvoice3_vc_live"),
    ("vc", None, "cosyvoice3_tts_live", "cosyvoice_vc_live"),
    ("vc", None, "my_renamed_live_vc", "my_renamed_live_vc"),  # a deployment's own name is kept
    ("tts", "cosyvoice_tts_live", "cosyvoice3_tts_live", "cosyvoice_tts_live"),  # given wins
])
def test_the_session_model(kind, given, own, want):
    assert session_model(kind, given, own) == want


def test_the_client_s_model_reaches_its_sessions(monkeypatch):
    """No server needed: the session is captured before it is run."""
    seen = []
    monkeypatch.setattr(LiveClient, "_run", lambda self, session, pieces: seen.append(session.model) or iter(()))
    monkeypatch.setattr(LiveClient, "validate_priority", lambda self, model, priority: priority)
    client = LiveClient("127.0.0.1:1", model="cosyvoice3_tts_live")
    try:
        list(client.tts_live(["Hi."], speaker_id="alice"))
        list(client.convert_live([[0.0] * 10], speaker_id="alice", sample_rate=16000))
        list(client.tts_live(["Hi."], speaker_id="alice", model="cosyvoice_tts_live"))
    finally:
        client.close()
    assert seen == ["cosyvoice3_tts_live", "cosyvoice_vc_live", "cosyvoice_tts_live"]
