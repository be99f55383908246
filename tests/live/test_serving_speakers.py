"""Registered speakers on the server: ``SpeakerService`` in process (the prompt equals ``CosyVoice2.prompt``;
register / get / list / delete; refusals naming the input; persistence in the folder) and the served ``speakers``
model over HTTP and gRPC."""

from __future__ import annotations

import numpy as np
import pytest
import soundfile as sf
from conftest import FIXTURES, PATIENCE_S

from cosyvoice_triton.clients.client import VCClient, VCError
from cosyvoice_triton.errors import CosyVoiceError
from cosyvoice_triton.serving.stages.speakers import SpeakerService
from cosyvoice_triton.speakers import SpeakerStore

TRANSCRIPT = "Hello, this is my voice."


@pytest.fixture(scope="module")
def prompt_audio():
    prm, psr = sf.read(FIXTURES / "prompt_en_3s.wav", dtype="float32")
    return prm[: int(2.0 * psr)], psr


@pytest.fixture(scope="module")
def model(serving_assets):
    from cosyvoice_triton.pipeline import CosyVoice2

    return CosyVoice2.from_pretrained(serving_assets["model_dir"])


def _service(serving_assets, folder) -> SpeakerService:
    from cosyvoice_triton.frontend.text import TextFrontend
    from cosyvoice_triton.serving.stages.local import LocalPipeline
    from cosyvoice_triton.serving.stages.speakers import TEXT_DIR

    local = LocalPipeline(serving_assets["model_dir"], serving_assets["onnx_dir"] / "fp32")
    graphs = {k: v.run for k, v in local.graphs.items()}
    text_dir = serving_assets["model_dir"] / TEXT_DIR
    return SpeakerService(SpeakerStore(folder, capacity=4), local.pre, graphs,
                          text_frontend=(lambda: TextFrontend(text_dir)) if text_dir.is_dir() else None)


def _bytes(x: str) -> np.ndarray:
    return np.array([[x.encode()]], dtype=object)


def _register(prm, psr, speaker_id, text=None):
    t = {"action": _bytes("register"), "speaker_id": _bytes(speaker_id), "prompt_audio": prm[None],
         "prompt_sample_rate": np.array([[psr]], np.int32)}
    if text is not None:
        t["prompt_text"] = _bytes(text)
    return t


def test_register_computes_the_pipeline_prompt(serving_assets, tmp_path, prompt_audio, model):
    prm, psr = prompt_audio
    service = _service(serving_assets, tmp_path)
    text = TRANSCRIPT if (serving_assets["model_dir"] / "CosyVoice-BlankEN").is_dir() else None
    out = service.handle(_register(prm, psr, "alice", text))
    ref = model.prompt(prm, prompt_sr=psr, prompt_text=text)
    np.testing.assert_array_equal(out["prompt_tokens"], ref.prompt_tokens)
    np.testing.assert_allclose(out["prompt_mel"], ref.prompt_mel, atol=1e-5)
    np.testing.assert_allclose(out["embedding"], ref.embedding, rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(out["prompt_text_tokens"], ref.prompt_text_tokens)
    assert out["prompt_mel"].shape == (2 * len(out["prompt_tokens"]), 80)
    got = service.handle({"action": _bytes("get"), "speaker_id": _bytes("alice")})
    np.testing.assert_array_equal(got["prompt_tokens"], out["prompt_tokens"])
    assert got["prompt_text"][0].decode() == (text or "")


def test_list_delete_and_persistence(serving_assets, tmp_path, prompt_audio):
    prm, psr = prompt_audio
    service = _service(serving_assets, tmp_path)
    for name in ("b_voice", "a_voice"):
        service.handle(_register(prm, psr, name))
    listed = service.handle({"action": _bytes("list")})["speaker_ids"]
    assert [x.decode() for x in listed] == ["a_voice", "b_voice"]
    again = _service(serving_assets, tmp_path)  # a restart: the folder is read back
    assert [x.decode() for x in again.handle({"action": _bytes("list")})["speaker_ids"]] == ["a_voice", "b_voice"]
    again.handle({"action": _bytes("delete"), "speaker_id": _bytes("a_voice")})
    assert again.store.list() == ["b_voice"] and not (tmp_path / "a_voice.npz").exists()


@pytest.mark.parametrize("tensors, message", [
    ({"action": _bytes("get"), "speaker_id": _bytes("nobody")}, "unknown speaker 'nobody'"),
    ({"action": _bytes("get"), "speaker_id": _bytes("../etc")}, "speaker_id '../etc' is invalid"),
    ({"action": _bytes("delete"), "speaker_id": _bytes("nobody")}, "unknown speaker 'nobody'"),
    ({"action": _bytes("shout")}, "action 'shout' is not one of"),
    ({"speaker_id": _bytes("x")}, "missing input 'action'"),
    ({"action": _bytes("get")}, "needs input 'speaker_id'"),
    ({"action": _bytes("register"), "speaker_id": _bytes("x")}, "prompt: missing input"),
    ({"action": _bytes("register"), "speaker_id": _bytes("x"), "prompt_audio": np.full((1, 16000), np.nan, np.float32),
      "prompt_sample_rate": np.array([[16000]], np.int32)}, "prompt_audio"),
])
def test_refusals_name_the_input(serving_assets, tmp_path, tensors, message):
    service = _service(serving_assets, tmp_path)
    with pytest.raises(CosyVoiceError, match=None) as info:
        service.handle(tensors)
    assert message in str(info.value)


# ------------------------------------------------------------------------------------------ served
@pytest.fixture(scope="module", params=["http", "grpc"])
def client(request, triton_server):
    url = triton_server.http_url if request.param == "http" else triton_server.grpc_url
    with VCClient(url, protocol=request.param, timeout=PATIENCE_S) as c:
        yield c


def test_served_register_get_list_delete(client, prompt_audio, model):
    prm, psr = prompt_audio
    name = f"served_{client.protocol}"
    registered = client.register_speaker(name, prm, prompt_sr=psr)
    ref = model.prompt(prm, prompt_sr=psr)
    np.testing.assert_array_equal(registered.prompt_tokens, ref.prompt_tokens)
    np.testing.assert_allclose(registered.embedding, ref.embedding, rtol=1e-4, atol=1e-5)
    assert name in client.list_speakers()
    got = client.get_speaker(name)
    np.testing.assert_array_equal(got.prompt_mel, registered.prompt_mel)
    client.delete_speaker(name)
    assert name not in client.list_speakers()
    with pytest.raises(VCError) as info:
        client.get_speaker(name)
    assert info.value.invalid_argument and f"unknown speaker {name!r}" in info.value.message
    with pytest.raises(VCError) as info:
        client.register_speaker("bad/id", prm, prompt_sr=psr)
    assert info.value.invalid_argument and "invalid" in info.value.message
    assert client.is_ready()


# ------------------------------------------------------------------------------------------ restart
def test_served_speaker_survives_a_server_restart(serving_assets, tmp_path_factory, prompt_audio):
    """Register through the ``speakers`` model, stop tritonserver, start a new one on the same speaker folder: the
    speaker is listed and TTS (``cosyvoice_tts``) and streaming VC by its id give the same audio as before."""
    from conftest import served

    from cosyvoice_triton.serving.repository import render_repository

    prm, psr = prompt_audio
    src, ssr = sf.read(FIXTURES / "source_en_5s.wav", dtype="float32")
    src = src[: int(2.5 * ssr)]
    root = tmp_path_factory.mktemp("restart")
    folder = root / "speakers"
    repo = root / "model_repository"
    render_repository("local", repo, model_dir=serving_assets["model_dir"], onnx_dir=serving_assets["onnx_dir"],
                      speaker_dir=str(folder))
    text = TRANSCRIPT if (serving_assets["model_dir"] / "CosyVoice-BlankEN").is_dir() else None

    def speak(server):
        with VCClient(server.http_url, timeout=PATIENCE_S) as c:
            listed = c.list_speakers()
            tts = c.tts("Good morning to you.", speaker_id="kept_voice", seed=3).waveform
        with VCClient(server.grpc_url, protocol="grpc", timeout=PATIENCE_S) as c:
            vc = np.concatenate([ch.waveform for ch in c.convert_stream(src, source_sr=ssr, speaker_id="kept_voice",
                                                                        seed=3)])
        return listed, tts, vc

    with served(repo) as first:
        with VCClient(first.http_url, timeout=PATIENCE_S) as c:
            registered = c.register_speaker("kept_voice", prm, prompt_sr=psr, prompt_text=text)
        listed, tts_before, vc_before = speak(first)
        first_pid = first.process.pid
    assert listed == ["kept_voice"] and (folder / "kept_voice.npz").is_file()
    with served(repo) as second:
        assert second.process.pid != first_pid
        with VCClient(second.http_url, timeout=PATIENCE_S) as c:
            kept = c.get_speaker("kept_voice")
        listed, tts_after, vc_after = speak(second)
    assert listed == ["kept_voice"]
    np.testing.assert_array_equal(kept.prompt_tokens, registered.prompt_tokens)
    np.testing.assert_array_equal(kept.prompt_mel, registered.prompt_mel)
    np.testing.assert_array_equal(kept.embedding, registered.embedding)
    assert kept.prompt_text == (text or "")
    assert tts_before.size > 0 and vc_before.size > ssr
    np.testing.assert_array_equal(tts_after, tts_before)
    np.testing.assert_array_equal(vc_after, vc_before)
