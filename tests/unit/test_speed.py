"""``speed`` (``cosyvoice_triton/models/speed.py``): the final mel stretched by linear interpolation before HiFT,
against PyTorch's ``F.interpolate(mel, size=int(T / speed), mode="linear")`` (what the official ``token2wav`` calls);
then where it is applied: the library's offline ``CosyVoice2.tts`` and the served TTS stage's non-streaming answer
(the tiny demo model), each checked on the mel that reaches HiFT, and refused on streams."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import FIXTURES

from cosyvoice_triton.errors import CosyVoiceError
from cosyvoice_triton.models.speed import change_speed, check_speed
from cosyvoice_triton.shapes import SAMPLES_PER_MEL_FRAME

SPEEDS = (0.25, 0.5, 0.8, 0.9, 1.1, 1.25, 1.5, 2.0, 3.3, 4.0)
BAR = 1e-6  # of the mel's peak: float32 rounding of the two-point blend (positions and weights are PyTorch's)


def _reference(mel: np.ndarray, speed: float) -> np.ndarray:
    """The official code's operation on ``mel`` [80, T]."""
    t = torch.from_numpy(np.ascontiguousarray(mel, np.float32))[None]
    return F.interpolate(t, size=int(t.shape[2] / speed), mode="linear")[0].numpy()


@pytest.mark.parametrize("frames", [1, 2, 3, 7, 50, 173, 1000, 3000])
def test_change_speed_is_pytorchs_linear_interpolation(frames):
    rng = np.random.default_rng(frames)
    for speed in SPEEDS:
        mel = rng.standard_normal((80, frames)).astype(np.float32) * 4
        got = change_speed(mel, speed)
        assert got.dtype == np.float32 and got.shape == (80, int(frames / speed))
        if got.shape[1]:
            np.testing.assert_allclose(got, _reference(mel, speed), rtol=0, atol=BAR * np.abs(mel).max())
        np.testing.assert_array_equal(change_speed(mel[None], speed)[0], got)  # any leading axes


def test_one_is_the_mel_itself_and_the_range_is_checked():
    mel = np.ones((80, 10), np.float32)
    assert change_speed(mel, 1.0) is mel
    assert check_speed(np.float32(2.5)) == 2.5
    for bad in (0.2, 4.5, float("nan"), float("inf"), "fast", None):
        with pytest.raises(CosyVoiceError, match="speed"):
            check_speed(bad)


# ----------------------------------------------------------------------------------------- on the demo model


@pytest.fixture(scope="module")
def prompt():
    import soundfile as sf

    wave, sr = sf.read(FIXTURES / "prompt_en_3s.wav", dtype="float32")
    return wave[: int(1.5 * sr)], sr


def _spy(monkeypatch, obj, name: str, record, *, index: int = 0, result: bool = False) -> list:
    """Wrap ``obj.name``: ``record`` each call's argument ``index`` (or its result)."""
    seen, real = [], getattr(obj, name)

    def wrapper(*args, **kw):
        out = real(*args, **kw)
        seen.append(record(out if result else args[index]))
        return out

    monkeypatch.setattr(obj, name, wrapper)
    return seen


def _check_stretched(flows: list, hifts: list, speed: float) -> None:
    assert flows and len(flows) == len(hifts)
    for mel, stretched in zip(flows, hifts, strict=True):
        assert stretched.shape == (80, int(mel.shape[-1] / speed))
        np.testing.assert_allclose(stretched, _reference(mel, speed), rtol=0, atol=BAR * np.abs(mel).max())


def test_library_offline_tts_stretches_the_mel_before_hift(serving_assets, prompt, monkeypatch):
    from cosyvoice_triton.pipeline import CosyVoice2

    model = CosyVoice2.from_pretrained(serving_assets["model_dir"], tts=True)
    wave, sr = prompt
    flows = _spy(monkeypatch, model, "_flow", lambda m: m[0].float().numpy().copy(), result=True)
    hifts = _spy(monkeypatch, model, "_hift", lambda m: m[0].float().numpy().copy())
    out = model.tts("Hello there, a short test.", prompt_audio=wave, prompt_sr=sr, speed=1.5, seed=2)
    _check_stretched(flows, hifts, 1.5)
    assert out.size == SAMPLES_PER_MEL_FRAME * sum(h.shape[-1] for h in hifts)
    with pytest.raises(CosyVoiceError, match="speed: only non-streaming"):
        model.tts("Hello.", prompt_audio=wave, prompt_sr=sr, speed=1.5, stream=True)
    with pytest.raises(CosyVoiceError, match="speed"):
        model.tts("Hello.", prompt_audio=wave, prompt_sr=sr, speed=9)


def test_served_offline_tts_stretches_the_mel_before_hift(serving_assets, prompt, monkeypatch):
    from cosyvoice_triton.serving.stages.batching import RequestError
    from cosyvoice_triton.serving.stages.graphs import GraphRunner
    from cosyvoice_triton.serving.stages.tts import TTSService
    from cosyvoice_triton.shapes import GRAPHS

    onnx = serving_assets["onnx_dir"] / "fp32"
    service = TTSService(serving_assets["model_dir"], {g: GraphRunner(g, onnx_path=onnx / f"{g}.onnx").run
                                                       for g in GRAPHS})
    wave, sr = prompt
    try:
        t = {"text": np.array([[b"Hello there, a short test."]], object), "prompt_audio": wave[None],
             "prompt_sample_rate": np.array([[sr]], np.int32), "seed": np.array([[2]], np.int64),
             "stream": np.zeros((1, 1), bool)}
        flows = _spy(monkeypatch, service, "flow", lambda m: np.array(m), result=True)
        hifts = _spy(monkeypatch, service, "hift", lambda m: np.array(m))
        out = list(service.responses({**t, "speed": np.array([[0.8]], np.float32)}))
        _check_stretched(flows, hifts, float(np.float32(0.8)))
        assert sum(r["waveform"].shape[1] for r in out) == SAMPLES_PER_MEL_FRAME * sum(h.shape[-1] for h in hifts)
        flows.clear(), hifts.clear()
        list(service.responses(t))  # no speed: the mel as it is
        assert all(np.array_equal(f, h) for f, h in zip(flows, hifts, strict=True))
        with pytest.raises(RequestError, match="speed: only non-streaming"):
            list(service.responses({**t, "stream": np.ones((1, 1), bool), "speed": np.array([[1.5]], np.float32)}))
        for bad, words in ((np.array([[9.0]], np.float32), "out of range"), (np.array([[2]], np.int64), "one float")):
            with pytest.raises(CosyVoiceError, match=words):
                list(service.responses({**t, "speed": bad}))
    finally:
        service.close()


def test_the_clients_send_speed_only_when_it_is_not_one():
    import tritonclient.grpc as grpcclient

    from cosyvoice_triton.clients.wire import build_tts_inputs

    def inputs(**kw):
        return {t.name(): t for t in build_tts_inputs(grpcclient, "Hi.", speaker_id="alice", **kw)}

    assert "speed" not in inputs() and "speed" not in inputs(speed=1.0)
    speed = inputs(speed=1.5)["speed"]
    assert (speed.datatype(), speed.shape()) == ("FP32", [1, 1])
