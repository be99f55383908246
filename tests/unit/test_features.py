"""The three front-end features: oracle parity (mel), independent references (Whisper, Kaldi fbank),
frame counts, batching and input checks."""

from __future__ import annotations

import librosa
import numpy as np
import pytest
import torch
from conftest import FIXTURES, rel_err

from cosyvoice_triton.config import MelConfig
from cosyvoice_triton.errors import AudioError
from cosyvoice_triton.frontend.audio import MEL_SR, TOKENIZER_SR, load_audio
from cosyvoice_triton.frontend.features import (
    cosyvoice_mel,
    cosyvoice_mel_batch,
    kaldi_fbank,
    kaldi_fbank_batch,
    kaldi_fbank_options,
    mel_basis,
    pad_batch,
    whisper_log_mel,
    whisper_log_mel_batch,
    whisper_mel_filters,
)

FLT_EPS = float(np.finfo(np.float32).eps)


@pytest.fixture(scope="module")
def speech16() -> np.ndarray:
    return load_audio(FIXTURES / "source_en_5s.wav", target_sr=TOKENIZER_SR)


@pytest.fixture(scope="module")
def speech24() -> np.ndarray:
    return load_audio(FIXTURES / "prompt_en_3s.wav", target_sr=MEL_SR)


def _noise(n: int, seed: int, amp: float = 0.1) -> np.ndarray:
    return (amp * np.random.default_rng(seed).standard_normal(n)).astype(np.float32)


# ------------------------------------------------------------------------------------- CosyVoice mel


@pytest.mark.parametrize("case", ["a", "b"])
def test_mel_matches_oracle(ref_npz, case):
    ref = ref_npz("mel_frontend")
    wav = ref[f"mel_{case}_wav"][0]  # [N] at 24 kHz
    expected = ref[f"mel_{case}_mel"][0].T  # official [1, 80, T] -> [T, 80]
    mel = cosyvoice_mel(wav)
    assert mel.dtype == np.float32 and mel.shape == (len(wav) // 480, 80) == expected.shape
    assert rel_err(mel, expected) <= 1e-5


def test_mel_basis_matches_oracle(ref_npz):
    ref = ref_npz("mel_frontend")
    np.testing.assert_array_equal(mel_basis(), ref["mel_basis"])
    assert mel_basis() is mel_basis(MelConfig())  # cached
    assert not mel_basis().flags.writeable


def test_mel_batch_matches_oracle_and_singles(ref_npz):
    ref = ref_npz("mel_frontend")
    feats, lengths = cosyvoice_mel_batch([ref["mel_a_wav"][0], ref["mel_b_wav"][0]])
    assert feats.shape == (2, 60, 80) and feats.dtype == np.float32
    np.testing.assert_array_equal(lengths, [60, 50])
    assert lengths.dtype == np.int32
    assert rel_err(feats[0], ref["mel_a_mel"][0].T) <= 1e-5
    assert rel_err(feats[1, :50], ref["mel_b_mel"][0].T) <= 1e-5
    np.testing.assert_array_equal(feats[1, 50:], 0.0)


def _matcha_mel_torch(y: np.ndarray, cfg: MelConfig) -> np.ndarray:
    """The matcha recipe in float64 torch, for configs the oracle does not cover."""
    x = torch.from_numpy(y.astype(np.float64))[None, None]
    pad = int((cfg.n_fft - cfg.hop_size) / 2)
    x = torch.nn.functional.pad(x, (pad, pad), mode="reflect")[0]
    spec = torch.stft(x, cfg.n_fft, hop_length=cfg.hop_size, win_length=cfg.win_size,
                      window=torch.hann_window(cfg.win_size, dtype=torch.float64), center=cfg.center,
                      pad_mode="reflect", onesided=True, return_complex=True)
    mag = torch.sqrt(spec.real**2 + spec.imag**2 + 1e-9)[0]
    basis = torch.from_numpy(librosa.filters.mel(sr=cfg.sampling_rate, n_fft=cfg.n_fft, n_mels=cfg.num_mels,
                                                 fmin=cfg.fmin, fmax=cfg.fmax)).double()
    return torch.log(torch.clamp(basis @ mag, min=1e-5)).numpy().T


@pytest.mark.parametrize("cfg", [
    MelConfig(),
    MelConfig(center=True),
    MelConfig(n_fft=1024, win_size=800, hop_size=256, sampling_rate=22050, fmax=None),
])
def test_mel_matches_torch_recipe(cfg, speech24):
    y = speech24 if cfg.sampling_rate == MEL_SR else _noise(20000, 3)
    mel = cosyvoice_mel(y, sample_rate=cfg.sampling_rate, config=cfg)
    expected = _matcha_mel_torch(y, cfg)
    assert mel.shape == expected.shape
    assert rel_err(mel, expected) <= 1e-5


@pytest.mark.parametrize(("n", "frames"), [(721, 1), (959, 1), (960, 2), (1439, 2), (24000, 50), (24123, 50)])
def test_mel_frame_counts(n, frames):
    assert cosyvoice_mel(_noise(n, n)).shape == (frames, 80)


def test_mel_input_errors():
    with pytest.raises(AudioError, match=r"^y: 720 samples are too few for cosyvoice_mel; at least 721"):
        cosyvoice_mel(_noise(720, 0))
    with pytest.raises(AudioError, match="cosyvoice_mel: needs 24000 Hz audio, got 16000 Hz"):
        cosyvoice_mel(_noise(24000, 0), sample_rate=16000)
    with pytest.raises(AudioError, match="1-D waveform"):
        cosyvoice_mel(_noise(24000, 0).reshape(2, -1))
    with pytest.raises(AudioError, match="float samples"):
        cosyvoice_mel((_noise(24000, 0) * 1000).astype(np.int16))
    bad = _noise(24000, 0)
    bad[5] = np.nan
    with pytest.raises(AudioError, match="NaN or Inf"):
        cosyvoice_mel(bad)
    with pytest.raises(AudioError, match=r"^waves\[1\]: 100 samples"):
        cosyvoice_mel_batch([_noise(24000, 0), _noise(100, 0)])
    with pytest.raises(ValueError, match="list of 1-D waveforms"):
        cosyvoice_mel_batch(_noise(24000, 0))
    with pytest.raises(ValueError, match="empty"):
        cosyvoice_mel_batch([])
    with pytest.raises(ValueError, match="bad MelConfig"):
        cosyvoice_mel(_noise(24000, 0), config=MelConfig(win_size=4000))


# ---------------------------------------------------------------------------------------- Whisper mel


def test_whisper_filters_are_librosa():
    for n_mels in (80, 128):
        expected = librosa.filters.mel(sr=16000, n_fft=400, n_mels=n_mels)
        np.testing.assert_array_equal(whisper_mel_filters(n_mels), expected)
    assert whisper_mel_filters().shape == (128, 201)
    with pytest.raises(ValueError, match="n_mels"):
        whisper_mel_filters(100)


def _whisper_torch(y: np.ndarray, n_mels: int = 128) -> np.ndarray:
    """whisper.log_mel_spectrogram's arithmetic (float32 torch.stft, centred, last frame dropped)."""
    audio = torch.from_numpy(y.astype(np.float32))
    spec = torch.stft(audio, 400, 160, window=torch.hann_window(400), return_complex=True)
    power = spec[:, :-1].abs() ** 2
    mel = torch.from_numpy(librosa.filters.mel(sr=16000, n_fft=400, n_mels=n_mels)) @ power
    log_spec = torch.clamp(mel, min=1e-10).log10()
    log_spec = torch.maximum(log_spec, log_spec.max() - 8.0)
    return ((log_spec + 4.0) / 4.0).numpy()


def _whisper_numpy_loop(y: np.ndarray, n_mels: int = 128) -> np.ndarray:
    """The same recipe frame by frame with a float64 DFT matrix."""
    y = np.pad(y.astype(np.float64), 200, mode="reflect")
    n = np.arange(400)
    window = 0.5 - 0.5 * np.cos(2 * np.pi * n / 400)
    dft = np.exp(-2j * np.pi * np.outer(np.arange(201), n) / 400)  # [201, 400]
    n_frames = (len(y) - 400) // 160  # 1 + (len - 400) // 160 frames, minus the dropped last one
    power = np.stack([np.abs(dft @ (y[160 * t:160 * t + 400] * window)) ** 2 for t in range(n_frames)],
                     axis=1)
    log_spec = np.log10(np.maximum(librosa.filters.mel(sr=16000, n_fft=400, n_mels=n_mels) @ power, 1e-10))
    return (np.maximum(log_spec, log_spec.max() - 8.0) + 4.0) / 4.0


@pytest.mark.parametrize("source", ["noise", "speech"])
def test_whisper_matches_references(source, speech16):
    y = _noise(16000 * 2 + 77, 5) if source == "noise" else speech16
    feats = whisper_log_mel(y)
    assert feats.dtype == np.float32 and feats.shape == (128, len(y) // 160)
    np.testing.assert_allclose(feats, _whisper_numpy_loop(y), atol=1e-5, rtol=0)
    np.testing.assert_allclose(feats, _whisper_torch(y), atol=2e-4, rtol=0)  # torch runs in float32
    assert feats.max() - feats.min() <= 2.0 + 1e-6  # floor at max - 8 decades, scaled by 1/4


def test_whisper_80_mels(speech16):
    np.testing.assert_allclose(whisper_log_mel(speech16, n_mels=80), _whisper_torch(speech16, 80), atol=2e-4)


@pytest.mark.parametrize(("n", "frames"), [(201, 1), (319, 1), (320, 2), (16000, 100), (16159, 100)])
def test_whisper_frame_counts(n, frames):
    assert whisper_log_mel(_noise(n, n)).shape == (128, frames)


def test_whisper_batch_equals_one_by_one(speech16):
    # A loud utterance next to a quiet, short one: the quiet one keeps its own (max - 8) floor.
    waves = [speech16, 0.001 * speech16[:16000 + 123], _noise(4000, 7)]
    feats, lengths = whisper_log_mel_batch(waves)
    assert feats.shape == (3, 128, len(speech16) // 160) and feats.dtype == np.float32
    np.testing.assert_array_equal(lengths, [len(w) // 160 for w in waves])
    for b, w in enumerate(waves):
        np.testing.assert_array_equal(feats[b, :, : lengths[b]], whisper_log_mel(w))
        np.testing.assert_array_equal(feats[b, :, lengths[b]:], 0.0)
    # per-utterance maxima: scaling a waveform by 1e-3 shifts log10 by 6/4 everywhere above the floor
    quiet = feats[1, :, : lengths[1]]
    loud = whisper_log_mel(speech16[:16000 + 123])
    assert quiet.max() == pytest.approx(loud.max() - 1.5, abs=1e-5)


def test_whisper_input_errors():
    with pytest.raises(AudioError, match="needs 16000 Hz audio, got 24000 Hz"):
        whisper_log_mel(_noise(16000, 0), sample_rate=24000)
    with pytest.raises(AudioError, match="200 samples are too few for whisper_log_mel; at least 201"):
        whisper_log_mel(_noise(200, 0))
    with pytest.raises(AudioError, match="1-D waveform"):
        whisper_log_mel_batch([_noise(16000, 0)[None]])


# --------------------------------------------------------------------------------------- Kaldi fbank


def _kaldi_fbank_numpy(y: np.ndarray, num_bins: int = 80, sr: int = 16000) -> np.ndarray:
    """Kaldi's fbank recipe with torchaudio's defaults, in float64: snip-edges framing of 25 ms / 10 ms,
    DC removal, pre-emphasis 0.97 (first sample against itself), povey window, 512-point power spectrum,
    triangular mel banks on 1127 ln(1 + f / 700) from 20 Hz to Nyquist (Nyquist bin unused), log with
    FLT_EPSILON floor."""
    length, shift, n_fft = 400, 160, 512
    n_frames = 1 + (len(y) - length) // shift
    frames = y.astype(np.float64)[np.arange(length)[None, :] + shift * np.arange(n_frames)[:, None]]
    frames = frames - frames.mean(axis=1, keepdims=True)
    previous = np.concatenate([frames[:, :1], frames[:, :-1]], axis=1)
    povey = (0.5 - 0.5 * np.cos(2 * np.pi * np.arange(length) / (length - 1))) ** 0.85
    power = np.abs(np.fft.rfft((frames - 0.97 * previous) * povey, n=n_fft)) ** 2  # [T, 257]

    def mel(f):
        return 1127.0 * np.log(1.0 + np.asarray(f) / 700.0)

    low, high = mel(20.0), mel(sr / 2)
    delta = (high - low) / (num_bins + 1)
    bin_mel = mel(np.arange(n_fft // 2 + 1) * sr / n_fft)
    left = low + delta * np.arange(num_bins)[:, None]
    banks = np.maximum(0.0, np.minimum(bin_mel - left, left + 2 * delta - bin_mel) / delta)
    banks[:, -1] = 0.0
    return np.log(np.maximum(power @ banks.T, FLT_EPS))


def test_fbank_options_are_torchaudio_defaults():
    opts = kaldi_fbank_options()
    f, m = opts.frame_opts, opts.mel_opts
    assert (f.samp_freq, f.frame_length_ms, f.frame_shift_ms, f.dither) == (16000, 25, 10, 0)
    assert f.preemph_coeff == pytest.approx(0.97) and f.blackman_coeff == pytest.approx(0.42)
    assert f.remove_dc_offset and f.round_to_power_of_two and f.snip_edges and f.window_type == "povey"
    assert (m.num_bins, m.low_freq, m.high_freq, m.vtln_low, m.vtln_high) == (80, 20, 0, 100, -500)
    assert not m.htk_mode and not m.is_librosa
    assert not opts.use_energy and opts.raw_energy and not opts.htk_compat
    assert opts.use_log_fbank and opts.use_power and opts.use_log_floor
    assert opts.eps == pytest.approx(FLT_EPS)


@pytest.mark.parametrize("source", ["noise", "speech"])
def test_fbank_matches_numpy_kaldi(source, speech16):
    y = _noise(16000 + 555, 9) if source == "noise" else speech16
    expected = _kaldi_fbank_numpy(y)
    raw = kaldi_fbank(y, subtract_mean=False)
    assert raw.dtype == np.float32 and raw.shape == expected.shape == (1 + (len(y) - 400) // 160, 80)
    np.testing.assert_allclose(raw, expected, atol=1e-3, rtol=0)
    normalised = kaldi_fbank(y)
    np.testing.assert_allclose(normalised, expected - expected.mean(axis=0), atol=1e-3, rtol=0)
    np.testing.assert_allclose(normalised.mean(axis=0), 0.0, atol=1e-5)


def test_fbank_scale_cancels_without_digital_silence():
    # Float vs int16 scale shifts every log energy by ln(32768**2); the mean subtraction removes it
    # unless some band is at the FLT_EPSILON floor (digital silence), so the official float input matters.
    y = _noise(8000, 11)
    np.testing.assert_allclose(kaldi_fbank(y * 32768), kaldi_fbank(y), atol=1e-3)
    with_silence = np.concatenate([np.zeros(3200, np.float32), y])
    assert np.abs(kaldi_fbank(with_silence * 32768) - kaldi_fbank(with_silence)).max() > 1.0


@pytest.mark.parametrize(("n", "frames"), [(400, 1), (559, 1), (560, 2), (16000, 98), (48000, 298)])
def test_fbank_frame_counts(n, frames):
    assert kaldi_fbank(_noise(n, n)).shape == (frames, 80)


def test_fbank_batch_equals_one_by_one(speech16):
    waves = [_noise(4000, 1), speech16, 0.01 * speech16[:8000]]
    feats, lengths = kaldi_fbank_batch(waves)
    assert feats.shape == (3, 1 + (len(speech16) - 400) // 160, 80) and feats.dtype == np.float32
    np.testing.assert_array_equal(lengths, [1 + (len(w) - 400) // 160 for w in waves])
    assert lengths.dtype == np.int32
    for b, w in enumerate(waves):
        np.testing.assert_array_equal(feats[b, : lengths[b]], kaldi_fbank(w))
        np.testing.assert_array_equal(feats[b, lengths[b]:], 0.0)


def test_fbank_input_errors():
    with pytest.raises(AudioError, match="399 samples are too few for kaldi_fbank; at least 400"):
        kaldi_fbank(_noise(399, 0))
    with pytest.raises(AudioError, match="needs 16000 Hz audio, got 8000 Hz"):
        kaldi_fbank(_noise(16000, 0), sample_rate=8000)
    with pytest.raises(AudioError, match=r"sample rate 16000\.5 Hz is not a whole number"):
        kaldi_fbank(_noise(16000, 0), sample_rate=16000.5)
    with pytest.raises(ValueError, match="num_mel_bins=200 is too many"):
        kaldi_fbank(_noise(16000, 0), num_mel_bins=200)
    with pytest.raises(TypeError, match="list of 1-D waveforms"):
        kaldi_fbank_batch(16000)
    assert kaldi_fbank_batch(w for w in [_noise(16000, 0)])[0].shape == (1, 98, 80)  # any iterable


def test_pad_batch():
    feats, lengths = pad_batch([np.ones((2, 3)), np.full((2, 1), 2.0)], time_axis=1)
    assert feats.dtype == np.float32 and lengths.dtype == np.int32
    np.testing.assert_array_equal(lengths, [3, 1])
    np.testing.assert_array_equal(feats, [[[1, 1, 1], [1, 1, 1]], [[2, 0, 0], [2, 0, 0]]])
