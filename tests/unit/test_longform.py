"""Long sources: cuts at low-energy points, stitching without clicks or level jumps, no change below 30 s, and a
2-minute conversion of the right length with clean seams (tiny demo model), also through the served stages."""

from __future__ import annotations

import itertools

import librosa
import numpy as np
import pytest
from conftest import FIXTURES

from cosyvoice_triton import longform
from cosyvoice_triton.errors import AudioError
from cosyvoice_triton.frontend import audio
from cosyvoice_triton.frontend.speech_models import speech_token_count
from cosyvoice_triton.models.demo import write_demo_model
from cosyvoice_triton.pipeline import CosyVoice2

SR = 16000
PROMPT = FIXTURES / "prompt_en_3s.wav"


def _bursts(seconds: float, seed: int = 0) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """Noise 'words' of 1.5-4 s separated by 0.3-0.6 s of near-silence: (16 kHz wave, the gaps in samples)."""
    rng = np.random.default_rng(seed)
    parts, gaps, n = [], [], 0
    while n < seconds * SR:
        word = int(rng.uniform(1.5, 4.0) * SR)
        parts.append(0.3 * rng.standard_normal(word) * np.hanning(word) ** 0.1)
        gap = int(rng.uniform(0.3, 0.6) * SR)
        parts.append(1e-4 * rng.standard_normal(gap))
        gaps.append((n + word, n + word + gap))
        n += word + gap
    return np.concatenate(parts)[: int(seconds * SR)].astype(np.float32), gaps


def _check_layout(pieces: list[longform.Piece], n: int) -> None:
    assert pieces[0].start == 0 and pieces[-1].end == n
    for p in pieces:
        assert p.end - p.start <= longform.SPLIT_ABOVE_SECONDS * SR
        assert p.start % longform.SAMPLES_PER_TOKEN == 0 and p.cut_before % longform.SAMPLES_PER_TOKEN == 0
    for a, b in itertools.pairwise(pieces):
        assert a.cut_after == b.cut_before  # the cores tile the source
        assert b.start == b.cut_before - longform.OVERLAP_TOKENS * longform.SAMPLES_PER_TOKEN
        assert a.end == a.cut_after + longform.OVERLAP_TOKENS * longform.SAMPLES_PER_TOKEN


def test_cuts_fall_in_the_pauses():
    wave, gaps = _bursts(95.0)
    pieces = longform.plan_pieces(wave)
    _check_layout(pieces, len(wave))
    assert len(pieces) in (4, 5, 6, 7)  # cores between ~14 and 29 s
    margin = longform.SAMPLES_PER_TOKEN  # the cut is on a token boundary, the RMS frame is one token wide
    for p in pieces[1:]:
        assert any(g0 - margin <= p.cut_before <= g1 + margin for g0, g1 in gaps), \
            f"cut at {p.cut_before / SR:.2f} s is not in a pause"


def test_up_to_30_s_is_one_piece():
    for seconds in (0.5, 25.0, 30.0):
        wave, _ = _bursts(seconds)
        assert longform.plan_pieces(wave) == [longform.Piece(0, len(wave), 0, len(wave))]
        assert not longform.needs_split(len(wave))
    assert longform.needs_split(30 * SR + 1)


def _outputs_of(signal: np.ndarray, pieces, *, own_rendering: bool = False) -> list[np.ndarray]:
    """What a conversion of each piece gives when it reproduces ``signal`` (24 kHz): its slice, token-exact; with
    ``own_rendering``, each piece its own rendering of the same kind of sound (unrelated phases: band-limited noise
    of its own seed, as two conversions of the same words differ sample by sample)."""
    outs = []
    for i, p in enumerate(pieces):
        n = int(speech_token_count((p.end - p.start) // 160)) * 960
        y = signal[p.output_offset : p.output_offset + n]
        if own_rendering:
            noise = np.random.default_rng(100 + i).standard_normal(n)
            y = (0.2 * np.convolve(noise, np.hanning(9) / 4, mode="same")).astype(np.float32)
        outs.append(y)
    return outs


def test_stitch_reproduces_a_continuous_signal_exactly():
    wave, _ = _bursts(70.0, seed=1)
    pieces = longform.plan_pieces(wave)
    n_out = int(speech_token_count(len(wave) // 160)) * 960
    t = np.arange(n_out) / 24000
    signal = (0.4 * np.sin(2 * np.pi * (100 * t + 3 * t**2)) * (1 + 0.5 * np.sin(2 * np.pi * 0.3 * t)))
    signal = signal.astype(np.float32)
    stitched = longform.stitch(_outputs_of(signal, pieces), pieces)
    assert stitched.shape == (n_out,)  # exactly the length of the unsplit conversion
    np.testing.assert_allclose(stitched, signal, rtol=0, atol=1e-6)


def test_seams_between_unaligned_pieces_have_no_click_or_level_jump():
    wave, _ = _bursts(70.0, seed=2)
    pieces = longform.plan_pieces(wave)
    n_out = int(speech_token_count(len(wave) // 160)) * 960
    outs = _outputs_of(np.zeros(n_out, np.float32), pieces, own_rendering=True)
    y = longform.stitch(outs, pieces)
    _check_seams(y, pieces)
    # a butt joint of the same pieces (no crossfade) does click: the check can fail
    butt = np.concatenate([o[: pieces[i + 1].output_offset - p.output_offset] if i + 1 < len(pieces) else o
                           for i, (p, o) in enumerate(zip(pieces, outs, strict=True))])
    with pytest.raises(AssertionError):
        _check_seams(butt, pieces)


def _check_seams(y: np.ndarray, pieces) -> None:
    """No clicks: the largest sample step within each crossfade is at most 1.5x the 99.9th percentile of the
    steps elsewhere; energy continuity: each 20 ms RMS frame in a crossfade is within 0.5-2x the median frame
    RMS of the second on either side."""
    step = np.abs(np.diff(y.astype(np.float64)))
    seam = np.zeros(len(step), bool)
    regions = []
    for a, b in itertools.pairwise(pieces):
        lo, hi = b.output_offset, int(a.end // longform.SAMPLES_PER_TOKEN * 960)
        regions.append((lo, hi))
        seam[max(lo - 1, 0) : hi] = True
    bound = 1.5 * np.percentile(step[~seam], 99.9)
    frame = 480
    rms = librosa.feature.rms(y=y, frame_length=frame, hop_length=frame, center=False)[0]
    for lo, hi in regions:
        assert step[max(lo - 1, 0) : hi].max() <= bound, f"click at the seam {lo}-{hi}"
        around = np.concatenate([rms[max(lo // frame - 50, 0) : lo // frame], rms[hi // frame + 1 : hi // frame + 51]])
        level = np.median(around)
        inside = rms[lo // frame : hi // frame]
        assert inside.min() >= 0.5 * level and inside.max() <= 2 * level, f"level jump at the seam {lo}-{hi}"


# ------------------------------------------------------------------------------------------- through the model

@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return CosyVoice2.from_pretrained(write_demo_model(tmp_path_factory.mktemp("demo") / "tiny", size="tiny"))


def _speech(seconds: float) -> np.ndarray:
    src = audio.load_audio(FIXTURES / "source_en_5s.wav", target_sr=SR)
    rng = np.random.default_rng(0)
    reps = int(np.ceil(seconds * SR / len(src)))
    return np.concatenate([src * rng.uniform(0.5, 1.0) for _ in range(reps)])[: int(seconds * SR)]


def test_25_s_source_converts_exactly_as_before(model, monkeypatch):
    src = _speech(25.0)

    def no_split(*a, **k):
        raise AssertionError("a 25 s source must not be split")

    monkeypatch.setattr(model, "convert_long", no_split)
    got = model.convert(src, PROMPT, source_sr=SR, seed=1)
    before = model.token2wav(model.frontend_vc(src, PROMPT, source_sr=SR), seed=1)  # the one-piece path
    np.testing.assert_array_equal(got, before)


def test_over_the_limits(model):
    with pytest.raises(AudioError, match="at most 600 s"):
        model.convert(np.ones(int(600.5 * SR), np.float32) * 0.1, PROMPT, source_sr=SR)
    with pytest.raises(AudioError, match="at most 30 s"):  # streaming stays within the tokenizer's 30 s
        model.convert(_speech(31.0), PROMPT, source_sr=SR, stream=True)


@pytest.mark.slow  # ~1 min on an idle 2-core CPU; 7 min measured with a load average of 15
@pytest.mark.timeout(2400)
def test_minutes_long_source_converts_with_clean_seams(model):
    src = _speech(125.0)
    src = np.concatenate([src, src[:1234]])  # not a whole number of tokens
    pieces = longform.plan_pieces(src)
    assert len(pieces) >= 5
    y = model.convert(src, PROMPT, source_sr=SR, seed=0)
    entry = model.prompt_features(PROMPT)
    prompt_offset = 2 * len(entry["prompt_tokens"]) - len(entry["prompt_mel"])  # as in the unsplit path
    assert len(y) == int(speech_token_count(len(src) // 160)) * 960 + prompt_offset * 480
    assert np.isfinite(y).all()
    _check_seams(y, pieces)


def test_pieces_go_through_the_served_stages_as_one_batch(serving_assets):
    """The served path (LocalPipeline: the ensemble's stages, batching and graphs in process): one batch of pieces,
    the right length, clean seams. Against a live server, :func:`longform.convert_served` sends the same pieces as
    concurrent ``cosyvoice_vc`` requests."""
    import soundfile as sf

    from cosyvoice_triton.serving.stages.local import LocalPipeline

    local = LocalPipeline(serving_assets["model_dir"], serving_assets["onnx_dir"] / "fp32")
    prm, psr = sf.read(PROMPT, dtype="float32")
    batches = []

    def convert(pieces):
        batches.append(len(pieces))
        requests = [{"source_audio": p[None], "source_sample_rate": np.array([[SR]], np.int32),
                     "prompt_audio": prm[None], "prompt_sample_rate": np.array([[psr]], np.int32)} for p in pieces]
        return [r.unwrap() for r in local.convert_batch(requests)]

    src = _speech(42.0)
    y = longform.convert_in_pieces(src, convert)
    pieces = longform.plan_pieces(src)
    assert batches == [len(pieces)] and len(pieces) == 2
    n_prompt_tokens = int(speech_token_count(len(audio.resample(prm, orig_sr=psr, target_sr=SR)) // 160))
    n_prompt_mel = len(local.pre.prompt_features(prm, psr)[2])
    assert len(y) == int(speech_token_count(len(src) // 160)) * 960 + (2 * n_prompt_tokens - n_prompt_mel) * 480
    _check_seams(y, pieces)
