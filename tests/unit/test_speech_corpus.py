"""The espeak-ng speech corpus used for calibration and held-out quality checks."""

from __future__ import annotations

import numpy as np
import pytest

from cosyvoice_triton.export.speech_corpus import TEXTS, espeak_available, synthesize, utterances

pytestmark = pytest.mark.skipif(not espeak_available(),
                                reason="no speech synthesiser (espeakng-loader wheel or espeak-ng command)")


def test_corpus_is_deterministic_and_varied():
    a = utterances(8, split="calibration", seed=1)
    b = utterances(8, split="calibration", seed=1)
    assert [u.text for u in a] == [u.text for u in b]
    assert all(np.array_equal(x.wave, y.wave) for x, y in zip(a, b, strict=True))
    assert len({u.voice for u in a}) >= 3 and len({u.speed_wpm for u in a}) >= 3
    assert all(1.0 <= u.seconds <= 12.0 and u.wave.dtype == np.float32 for u in a)
    assert all(np.abs(u.wave).max() > 0.05 for u in a)  # speech, not silence
    assert [u.text for u in utterances(8, split="calibration", seed=2)] != [u.text for u in a]


def test_splits_share_no_sentence():
    sentences = {s for texts in TEXTS.values() for s in texts}

    def used(split):
        return {s for u in utterances(40, split=split) for s in sentences if s in u.text}

    cal, held = used("calibration"), used("heldout")
    assert cal and held and not cal & held


def test_synthesize_and_errors():
    wave, sr = synthesize("hello world", voice="en-us")
    assert sr == 22050 and 0.3 < len(wave) / sr < 3
    with pytest.raises(ValueError, match="split must be one of"):
        utterances(1, split="test")
