"""Audio input: decoding (path and bytes), channel mixing, PCM scaling, validation errors, resampling."""

from __future__ import annotations

import io

import numpy as np
import pytest
import soundfile
from conftest import FIXTURES

from cosyvoice_triton.errors import AudioError
from cosyvoice_triton.frontend.audio import (
    MAX_SECONDS,
    MEL_SR,
    MIN_SECONDS,
    SILENCE_PEAK,
    TOKENIZER_SR,
    decode_audio,
    decode_if_encoded,
    load_audio,
    resample,
    to_mono_float32,
    validate_audio,
    validate_sample_rate,
)

# name -> (sample rate, samples) of the committed espeak-ng fixtures (see tests/fixtures/README.md)
FIXTURE_FILES = {
    "source_en_5s.wav": (24000, 120000),
    "prompt_en_3s.wav": (22050, 66150),
    "speech_engb_16k.wav": (16000, 67200),
}


def _tone(freq: float, seconds: float, sr: int, amp: float = 0.5) -> np.ndarray:
    t = np.arange(round(seconds * sr)) / sr
    return (amp * np.sin(2 * np.pi * freq * t)).astype(np.float32)


def _soxr_len(n: int, orig: int, target: int) -> int:
    """floor(n * target / orig + 1/2): soxr rounds halves up."""
    return (2 * n * target + orig) // (2 * orig)


def _encode(y: np.ndarray, sr: int, **kwargs) -> bytes:
    buf = io.BytesIO()
    soundfile.write(buf, y, sr, **kwargs)
    return buf.getvalue()


# ------------------------------------------------------------------------------------------- decoding


@pytest.mark.parametrize("fname", sorted(FIXTURE_FILES))
def test_fixture_round_trip_path_and_bytes(fname):
    sr_expected, n_expected = FIXTURE_FILES[fname]
    path = FIXTURES / fname
    assert path.stat().st_size < 300_000
    y, sr = decode_audio(path)
    y_str, _ = decode_audio(str(path))
    y_bytes, sr_bytes = decode_audio(path.read_bytes())
    assert (sr, sr_bytes) == (sr_expected, sr_expected)
    assert y.dtype == np.float32 and y.shape == (n_expected,)
    np.testing.assert_array_equal(y, y_bytes)
    np.testing.assert_array_equal(y, y_str)
    # 16-bit PCM scaled by 1/32768, as torchaudio.load does.
    pcm, _ = soundfile.read(path, dtype="int16")
    np.testing.assert_array_equal(y, pcm.astype(np.float32) / 32768.0)
    assert 0.5 < np.abs(y).max() < 0.75  # normalised to about -3 dBFS
    validate_audio(y, sample_rate=sr)  # real speech passes every check


def test_stereo_file_is_averaged():
    rng = np.random.default_rng(1)
    left = rng.uniform(-0.5, 0.5, 8000)
    right = rng.uniform(-0.5, 0.5, 8000)
    data = _encode(np.stack([left, right], axis=1), 16000, format="WAV", subtype="FLOAT")
    y, sr = decode_audio(data)
    assert sr == 16000 and y.shape == (8000,)
    np.testing.assert_allclose(y, (left.astype(np.float32) + right.astype(np.float32)) / 2, atol=1e-7)


def test_multichannel_file_is_averaged():
    rng = np.random.default_rng(2)
    chans = rng.uniform(-0.5, 0.5, (4000, 6)).astype(np.float32)
    y, _ = decode_audio(_encode(chans, 16000, format="WAV", subtype="FLOAT"))
    np.testing.assert_allclose(y, chans.mean(axis=1), atol=1e-7)


@pytest.mark.parametrize(("fmt", "subtype", "atol"), [
    ("WAV", "PCM_16", 1 / 32768), ("WAV", "PCM_32", 1e-7), ("WAV", "FLOAT", 0), ("FLAC", "PCM_16", 1 / 32768),
    ("OGG", "VORBIS", 0.05),
])
def test_formats_decode(fmt, subtype, atol):
    x = _tone(440, 0.5, 16000)
    y, sr = decode_audio(_encode(x, 16000, format=fmt, subtype=subtype))
    assert sr == 16000 and y.dtype == np.float32
    assert abs(len(y) - len(x)) <= (0 if fmt != "OGG" else 1024)
    n = min(len(x), len(y))
    np.testing.assert_allclose(y[:n], x[:n], atol=atol)


@pytest.mark.parametrize("data", [b"not audio at all", b"RIFF\x00\x00\x00\x00WAVEfmt " + bytes(64)])
def test_undecodable_bytes(data):
    with pytest.raises(AudioError, match=r"prompt_audio: the bytes are not a readable wav/flac/ogg file"):
        decode_audio(data, name="prompt_audio")


def test_decode_errors(tmp_path):
    with pytest.raises(AudioError, match="source_audio: empty"):
        decode_audio(b"", name="source_audio")
    with pytest.raises(AudioError, match="no such file"):
        decode_audio(tmp_path / "missing.wav")
    (tmp_path / "junk.wav").write_bytes(b"junk" * 100)
    with pytest.raises(AudioError, match=r"junk\.wav is not a readable wav/flac/ogg file"):
        decode_audio(tmp_path / "junk.wav")
    with pytest.raises(TypeError, match="bytes or a path"):
        decode_audio(12345)


def test_decode_refuses_long_file_from_header():
    data = _encode(np.full(31 * 4000, 0.1, np.float32), 4000, format="WAV", subtype="PCM_16")
    with pytest.raises(AudioError, match=r"audio: 31 s is too long; at most 30 s"):
        decode_audio(data, max_seconds=MAX_SECONDS)
    assert decode_audio(data)[0].shape == (31 * 4000,)


# ---------------------------------------------------------------------------------- arrays and dtypes


def test_int_pcm_scaling():
    np.testing.assert_array_equal(to_mono_float32(np.array([-32768, 0, 16384, 32767], np.int16)),
                                  np.array([-1.0, 0.0, 0.5, 32767 / 32768], np.float32))
    np.testing.assert_array_equal(to_mono_float32(np.array([-(2**31), 2**30], np.int32)),
                                  np.array([-1.0, 0.5], np.float32))
    np.testing.assert_array_equal(to_mono_float32(np.array([-128, 64], np.int8)),
                                  np.array([-1.0, 0.5], np.float32))
    np.testing.assert_array_equal(to_mono_float32(np.array([0, 128, 192], np.uint8)),
                                  np.array([-1.0, 0.0, 0.5], np.float32))


def test_float_passthrough_and_loud_audio_kept():
    x = np.array([0.25, -1.5, 3.0], np.float64)  # louder than full scale: kept, not clipped
    y = to_mono_float32(x)
    assert y.dtype == np.float32
    np.testing.assert_array_equal(y, x.astype(np.float32))
    x32 = np.linspace(-1, 1, 16, dtype=np.float32)
    assert to_mono_float32(x32) is x32


@pytest.mark.parametrize("layout", ["channels_first", "channels_last"])
def test_array_stereo_to_mono(layout):
    stereo = np.stack([np.full(1000, 0.5, np.float32), np.full(1000, -0.25, np.float32)])
    arr = stereo if layout == "channels_first" else stereo.T
    np.testing.assert_allclose(to_mono_float32(arr), np.full(1000, 0.125, np.float32))
    pcm = (arr * 32768).astype(np.int16)
    np.testing.assert_allclose(to_mono_float32(pcm), np.full(1000, 0.125, np.float32))
    assert to_mono_float32(stereo[:1]).shape == (1000,)  # [1, N]


@pytest.mark.parametrize(("value", "words"), [
    (np.zeros((2, 3, 100), np.float32), "3-D array of shape"),
    (np.float32(0.5), "0-D array"),
    (np.zeros((100, 200), np.float32), "cannot tell channels from time"),
    (np.array([1, 2, 3], np.int64), "int64 samples are ambiguous"),
    (np.array([1, 2, 3], np.uint16), "uint16 samples are ambiguous"),
    (np.array([True, False]), "boolean dtype"),
    (np.array([1 + 1j, 0j]), "complex dtype"),
    (np.array(["a", "b"]), "non-numeric dtype"),
    (np.array([object(), object()]), "non-numeric dtype"),
])
def test_bad_arrays(value, words):
    with pytest.raises(AudioError, match=words):
        to_mono_float32(value, name="source_audio")
    with pytest.raises(AudioError, match=r"^source_audio: "):
        validate_audio(value, sample_rate=16000, name="source_audio")


# ----------------------------------------------------------------------------------------- validation


def test_validation_errors_name_the_input_and_the_problem():
    sr = 16000
    speech = _tone(200, 1.0, sr)
    with pytest.raises(AudioError, match=r"^prompt_audio: empty \(0 samples\)$"):
        validate_audio(np.zeros(0, np.float32), sample_rate=sr, name="prompt_audio")
    with pytest.raises(AudioError, match=r"^prompt_audio: 0\.02 s is too short; at least 0\.1 s is needed$"):
        validate_audio(speech[:320], sample_rate=sr, name="prompt_audio")
    with pytest.raises(AudioError, match=r"0\.02 s is too short; at least 0\.5 s is needed"):
        validate_audio(speech[:320], sample_rate=sr, min_seconds=0.5)
    bad = speech.copy()
    bad[8000] = np.nan
    bad[9000:9002] = np.inf
    with pytest.raises(AudioError, match=r"1 NaN and 2 infinite samples \(first at 0\.5 s\)"):
        validate_audio(bad, sample_rate=sr)
    with pytest.raises(AudioError, match=r"audio: silent \(peak 0 of full scale"):
        validate_audio(np.zeros(sr, np.float32), sample_rate=sr)
    with pytest.raises(AudioError, match="silent"):  # one 16-bit LSB of dither is still digital silence
        validate_audio(np.full(sr, 1 / 32768, np.float32), sample_rate=sr)
    quiet = speech / np.abs(speech).max() * (2 * SILENCE_PEAK)  # about -74 dBFS: quiet but not silent
    assert validate_audio(quiet, sample_rate=sr).shape == (sr,)


def test_too_long_and_the_limit_itself():
    sr = 4000
    ok = _tone(100, MAX_SECONDS, sr)
    assert validate_audio(ok, sample_rate=sr).shape == (120000,)  # exactly 30 s is accepted
    too_long = r"^source_audio: 30\.000\d s is too long; at most 30 s is accepted$"
    with pytest.raises(AudioError, match=too_long):
        validate_audio(np.concatenate([ok, ok[:1]]), sample_rate=sr, name="source_audio")
    assert validate_audio(np.concatenate([ok, ok]), sample_rate=sr, max_seconds=None).shape == (240000,)


def test_shortest_accepted():
    sr = 16000
    assert validate_audio(_tone(300, MIN_SECONDS, sr), sample_rate=sr).shape == (1600,)
    with pytest.raises(AudioError, match="too short"):
        validate_audio(_tone(300, MIN_SECONDS, sr)[:-1], sample_rate=sr)


def test_clipped_audio_is_accepted():
    clipped = np.clip(_tone(300, 1.0, 16000, amp=3.0), -1.0, 1.0)
    np.testing.assert_array_equal(validate_audio(clipped, sample_rate=16000), clipped)


@pytest.mark.parametrize(("rate", "words"), [
    (0, "must be positive"), (-16000, "must be positive"), (22050.5, "not a whole number"),
    (float("nan"), "not a whole number"), (3999, "outside the supported range 4000..384000"),
    (384001, "outside the supported range"), ("16000", "must be a number of Hz"), (True, "must be a number"),
    (None, "must be a number"),
])
def test_bad_sample_rates(rate, words):
    with pytest.raises(AudioError, match=words):
        validate_sample_rate(rate, name="prompt_audio")
    with pytest.raises(AudioError, match=r"^prompt_audio: sample rate"):
        validate_audio(_tone(100, 1.0, 16000), sample_rate=rate, name="prompt_audio")


def test_good_sample_rates():
    assert validate_sample_rate(22050.0) == 22050
    assert validate_sample_rate(np.int64(16000)) == 16000
    assert validate_sample_rate(np.float32(48000)) == 48000
    assert isinstance(validate_sample_rate(np.float64(8000)), int)


def test_bad_duration_limits():
    with pytest.raises(ValueError, match="bad duration limits"):
        validate_audio(_tone(100, 1.0, 16000), sample_rate=16000, min_seconds=2.0, max_seconds=1.0)


# ----------------------------------------------------------------------------------------- resampling


@pytest.mark.parametrize("fname", sorted(FIXTURE_FILES))
@pytest.mark.parametrize("target", [TOKENIZER_SR, MEL_SR])
def test_resample_lengths(fname, target):
    sr, n = FIXTURE_FILES[fname]
    y = load_audio(FIXTURES / fname, target_sr=target)
    assert y.dtype == np.float32 and y.ndim == 1
    assert len(y) == _soxr_len(n, sr, target)


@pytest.mark.parametrize(("orig", "target"), [(24000, 16000), (22050, 16000), (44100, 24000), (16000, 24000)])
def test_resample_odd_lengths(orig, target):
    for n in (1601, 12345, 22051):
        y = resample(np.random.default_rng(n).uniform(-0.5, 0.5, n).astype(np.float32), orig_sr=orig,
                     target_sr=target)
        assert y.shape == (_soxr_len(n, orig, target),) and y.dtype == np.float32


def test_sine_survives_24k_to_16k():
    x = _tone(1000.0, 1.0, 24000, amp=0.5)
    y = resample(x, orig_sr=24000, target_sr=16000)
    assert y.shape == (16000,)
    spectrum = np.abs(np.fft.rfft(y * np.hanning(len(y))))
    peak_hz = np.argmax(spectrum) * 16000 / len(y)
    assert peak_hz == pytest.approx(1000.0, abs=1.0)
    # soxr is linear phase with its delay removed: the interior equals the ideal 16 kHz sine.
    ideal = _tone(1000.0, 1.0, 16000, amp=0.5)
    np.testing.assert_allclose(y[1000:-1000], ideal[1000:-1000], atol=1e-3)


def test_resample_identity_and_errors():
    x = _tone(100, 0.5, 16000)
    assert resample(x, orig_sr=16000, target_sr=16000) is x
    assert resample(x.astype(np.float64), orig_sr=16000, target_sr=24000).dtype == np.float32
    with pytest.raises(AudioError, match="1-D float waveform"):
        resample(np.stack([x, x]), orig_sr=16000, target_sr=24000)
    with pytest.raises(AudioError, match="1-D float waveform"):
        resample((x * 32767).astype(np.int16), orig_sr=16000, target_sr=24000)
    with pytest.raises(AudioError, match="target_sr: sample rate 1000 Hz is outside"):
        resample(x, orig_sr=16000, target_sr=1000)
    with pytest.raises(ValueError, match="quality"):
        resample(x, orig_sr=16000, target_sr=24000, quality="LQ")


# ------------------------------------------------------------------------------------------ load_audio


def test_load_audio_sources_agree():
    path = FIXTURES / "prompt_en_3s.wav"
    from_path = load_audio(path, target_sr=MEL_SR, name="prompt_audio")
    from_bytes = load_audio(path.read_bytes(), target_sr=MEL_SR, name="prompt_audio")
    pcm, sr = soundfile.read(path, dtype="int16")
    from_int16 = load_audio(pcm, sample_rate=sr, target_sr=MEL_SR)
    assert from_path.shape == (72000,)
    np.testing.assert_array_equal(from_path, from_bytes)
    np.testing.assert_array_equal(from_path, from_int16)


def test_load_audio_argument_errors():
    path = FIXTURES / "speech_engb_16k.wav"
    with pytest.raises(ValueError, match="sample_rate is required"):
        load_audio(np.zeros(16000, np.float32), target_sr=16000)
    with pytest.raises(ValueError, match="only for arrays"):
        load_audio(path, target_sr=16000, sample_rate=16000)
    with pytest.raises(AudioError, match=r"^prompt_audio: silent"):
        load_audio(np.zeros(16000, np.float32), sample_rate=16000, target_sr=24000, name="prompt_audio")
    with pytest.raises(AudioError, match=r"^prompt_audio: 4\.2 s is too long; at most 3 s"):
        load_audio(path, target_sr=16000, name="prompt_audio", max_seconds=3.0)
    with pytest.raises(AudioError, match=r"^prompt_audio: 4\.2 s is too short; at least 5 s"):
        load_audio(path, target_sr=16000, name="prompt_audio", min_seconds=5.0)


def test_decode_if_encoded():
    path = FIXTURES / "speech_engb_16k.wav"
    for source in (path, str(path), path.read_bytes()):
        y, sr = decode_if_encoded(source, name="prompt_audio")
        assert sr == 16000
        np.testing.assert_array_equal(y, decode_audio(path)[0])
    samples = np.zeros(10, np.int16)
    y, sr = decode_if_encoded(samples, 8000)
    assert y is samples and sr == 8000  # arrays pass through, unvalidated
    with pytest.raises(ValueError, match="^prompt_audio: sample_rate is only for arrays"):
        decode_if_encoded(path, 16000, name="prompt_audio")
    with pytest.raises(ValueError, match="^prompt_audio: sample_rate is required"):
        decode_if_encoded(samples, name="prompt_audio")
    long = _encode(np.full(31 * 4000, 0.1, np.float32), 4000, format="WAV", subtype="PCM_16")
    with pytest.raises(AudioError, match="at most 30 s"):  # MAX_SECONDS unless told otherwise
        decode_if_encoded(long)
    assert decode_if_encoded(long, max_seconds=None)[0].shape == (31 * 4000,)
