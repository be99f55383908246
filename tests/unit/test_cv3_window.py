"""CosyVoice3's token-to-wav over a sliding window (``models/cosyvoice3/window.py``) against the official streaming
path (``Token2Wav3``, equal to the official ``CosyVoice3Model.token2wav`` in test_cv3_token2wav.py).

The vocoder window's samples equal the whole-stream call's (the release's dimensions too) once its context covers
the receptive field, and not without context; its state stays bounded; past the official 300 s its phase sum is
reduced and the audio stays the same. The token window run on the official schedule, never sliding, is the
official stream; once it slides, the chunks before the first slide are still the official ones.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cosyvoice_triton.errors import CosyVoiceError
from cosyvoice_triton.models.cosyvoice3 import vocoder_window as window_mod
from cosyvoice_triton.models.cosyvoice3.hift import CausalHiFTGenerator, Hift3Dims
from cosyvoice_triton.models.cosyvoice3.token2wav import Token2Wav3, _Vocoded
from cosyvoice_triton.models.cosyvoice3.window import VOCODER_CONTEXT_FRAMES, Token2Wav3Window, VocoderWindow
from cosyvoice_triton.streaming import stream_chunks


@pytest.fixture(scope="module")
def t2w(cv3_demo_dir) -> Token2Wav3:
    from cosyvoice_triton.models.cosyvoice3.pipeline import CosyVoice3

    return CosyVoice3.from_pretrained(cv3_demo_dir, tts=False).token2wav_model


def _mel(frames: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, 80, frames, generator=g) * 2 - 5


def _ends(frames: int, chunk: int) -> list[tuple[int, int]]:
    ends = [*range(chunk, frames, chunk), frames]
    return list(zip([0, *ends[:-1]], ends, strict=True))


def _official_vocoder(hift, mel: torch.Tensor, chunk: int) -> np.ndarray:
    """Token2Wav3's streaming vocoder: the whole mel so far at each chunk (the official hift_cache_dict path)."""
    vocode, out = _Vocoded(hift), []
    for lo, hi in _ends(mel.shape[2], chunk):
        out.append(vocode(mel[:, :, lo:hi], final=hi == mel.shape[2]))
    return np.concatenate(out)


def _windowed(hift, mel: torch.Tensor, chunk: int, **kw) -> tuple[np.ndarray, VocoderWindow]:
    w, out = VocoderWindow(hift, **kw), []
    for lo, hi in _ends(mel.shape[2], chunk):
        out.append(w(mel[:, :, lo:hi], final=hi == mel.shape[2]))
    return np.concatenate(out), w


@pytest.mark.parametrize("dims", ["demo", "release"])
def test_vocoder_window_equals_the_whole_stream_call(t2w, dims):
    """Default context: the official samples to float rounding; no context: not (the bar can fail)."""
    if dims == "demo":
        hift = t2w.hift
    else:
        torch.manual_seed(0)
        hift = CausalHiFTGenerator(Hift3Dims.full(), noise_seed=5).eval()
    mel = _mel(300)
    official = _official_vocoder(hift, mel, 50)
    got, w = _windowed(hift, mel, 50)
    assert got.shape == official.shape == (300 * hift.upsample_factor,)
    assert np.abs(got - official).max() <= 1e-5 * max(1.0, float(np.abs(official).max()))
    assert w.base > 0  # the window did slide
    blind, _ = _windowed(hift, mel, 50, context_frames=0)
    assert np.abs(blind - official).max() > 1e-3 * float(np.abs(official).max())


def test_vocoder_window_state_stays_bounded(t2w):
    hift, chunk = t2w.hift, 50
    mel = _mel(40 * chunk, seed=1)
    w = VocoderWindow(hift)
    held = []
    for lo, hi in _ends(mel.shape[2], chunk)[:-1]:
        w(mel[:, :, lo:hi], final=False)
        held.append((w.mel.shape[2], w.f0.shape[1], w.noise.held))
    most = VOCODER_CONTEXT_FRAMES + chunk + hift.dims.held_frames
    assert max(m for m, _, _ in held) <= most and max(f for _, f, _ in held) <= most
    assert max(n for _, _, n in held) <= most * hift.upsample_factor
    assert w.base >= 38 * chunk - most


def test_phase_sum_reduced_past_the_official_range(t2w, monkeypatch):
    """Past the official 300 s (made 1 s here) the phase sum is kept modulo one sample-rate cycle: the audio stays
    the whole-stream call's up to the float32 rounding of the unreduced phase (one ulp of a phase of ~1e5 rad after
    12 s is ~0.016 rad: 8e-4 of the peak measured, bar 3e-3)."""
    hift = t2w.hift
    mel = _mel(600, seed=2)
    official = _official_vocoder(hift, mel, 50)
    monkeypatch.setattr(window_mod, "NOISE_MAX_SAMPLES", 24000)
    got, w = _windowed(hift, mel, 50)
    assert float(w.phase0.max()) < 1.0 / hift.upsample_factor
    assert np.abs(got - official).max() <= 3e-3 * float(np.abs(official).max())


def _prompt(t2w, n_tokens: int = 40, seed: int = 4):
    rng = np.random.default_rng(seed)
    return (rng.integers(0, t2w.flow.dims.vocab_size, n_tokens).astype(np.int32),
            rng.normal(-5, 2, (2 * n_tokens, 80)).astype(np.float32), rng.normal(0, 1, 192).astype(np.float32))


def test_token_window_on_the_official_schedule_is_the_official_stream(t2w):
    prompt = _prompt(t2w)
    tokens = np.random.default_rng(5).integers(0, t2w.flow.dims.vocab_size, 260).astype(np.int32)
    official = list(t2w.token2wav_stream(tokens.tolist(), *prompt))
    win = Token2Wav3Window(t2w, *prompt)
    got = [win.step(c.tokens, c.offset, final=c.final)
           for c in stream_chunks(tokens.tolist(), len(prompt[0]), lookahead=3, schedule=t2w.schedule)]
    assert [len(c) for c in got] == [len(c) for c in official] and len(got) >= 4
    a, b = np.concatenate(got), np.concatenate(official)
    assert np.abs(a - b).max() <= 1e-5 * max(1.0, float(np.abs(b).max()))


def test_sliding_token_window_keeps_the_chunks_before_it_slides(t2w):
    """25-token chunks, a window of 50 tokens before each chunk: the chunks whose window still starts at the first
    token are the unbounded window's; later ones see fewer tokens (the documented approximation) and differ."""
    prompt = _prompt(t2w, n_tokens=50)
    tokens = np.random.default_rng(6).integers(0, t2w.flow.dims.vocab_size, 203).astype(np.int32)

    def run(context: int) -> list[np.ndarray]:
        win, out, done = Token2Wav3Window(t2w, *prompt), [], 0
        for end in range(25, 200, 25):
            start = max(0, (done - context) // 25 * 25)
            out.append(win.step(tokens[start: end + 3], done - start, final=False))
            done = end
        start = max(0, (done - context) // 25 * 25)
        out.append(win.step(tokens[start:], done - start, final=True))
        return out

    bounded, unbounded = run(50), run(1000)
    assert [len(c) for c in bounded] == [len(c) for c in unbounded]
    same = 3  # chunks ending at 25, 50, 75 see the window from token 0; the chunk ending at 100 starts at 25
    np.testing.assert_allclose(np.concatenate(bounded[:same]), np.concatenate(unbounded[:same]), atol=1e-6)
    assert np.abs(np.concatenate(bounded[same:]) - np.concatenate(unbounded[same:])).max() > 1e-4
    assert all(np.isfinite(c).all() for c in bounded)


def test_token_window_refuses_what_it_cannot_place(t2w):
    win = Token2Wav3Window(t2w, *_prompt(t2w))
    with pytest.raises(CosyVoiceError, match="no new token"):
        win.step(np.arange(5), 2, final=False)
    with pytest.raises(CosyVoiceError, match="out of range"):
        win.step(np.array([t2w.flow.dims.vocab_size] * 30), 0, final=False)
    with pytest.raises(ValueError, match="only 0 tokens were produced"):
        win.step(np.arange(30), 5, final=False)
