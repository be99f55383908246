"""The served loudness meter reads BS.1770-4 values (pyloudnorm, DeMan K-weighting) at every served rate."""

from __future__ import annotations

import numpy as np
import pytest

from cosyvoice_triton.serving.stages.postprocess import integrated_loudness


@pytest.mark.parametrize("rate", [16000, 22050, 24000, 48000])
def test_a_997_hz_sine_at_minus_20_dbfs_reads_minus_23_lufs(rate):
    t = np.arange(5 * rate) / rate
    # BS.1770: a 0 dBFS sine in the 1 kHz region reads -3.01 LKFS, so 0.1 (-20 dB) reads -23.01. The standard's
    # filters are defined at 48 kHz; derived for lower rates, the bilinear transform shifts the 1.5 kHz shelf and
    # the reading moves by 0.03 LU at 16-24 kHz (-22.97 ... -22.98).
    bar = 0.005 if rate == 48000 else 0.05
    assert integrated_loudness(0.1 * np.sin(2 * np.pi * 997 * t), rate) == pytest.approx(-23.01, abs=bar)


def test_gain_moves_the_reading_by_the_same_decibels():
    rng = np.random.default_rng(0)
    x = rng.standard_normal(3 * 24000) * 0.05
    louder = integrated_loudness(2 * x, 24000) - integrated_loudness(x, 24000)
    assert louder == pytest.approx(20 * np.log10(2), abs=1e-6)


def test_silence_and_audio_shorter_than_a_gating_block_read_minus_inf():
    assert integrated_loudness(np.zeros(24000), 24000) == float("-inf")
    assert integrated_loudness(np.full(int(0.39 * 24000), 0.1), 24000) == float("-inf")
