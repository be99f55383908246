"""Audio input: decode, mix to mono, validate and resample.

Everything returned here is a 1-D ``float32`` waveform on the [-1, 1] full scale (integer PCM is divided by
its full-scale value, as ``soundfile`` and ``torchaudio.load`` do), so that every feature of
:mod:`cosyvoice_triton.frontend.features` sees the same numbers as the official front end.

Typical use, decoding once for the two rates the model needs::

    y, sr = decode_audio(request_bytes, name="prompt_audio", max_seconds=MAX_SECONDS)
    wav16 = load_audio(y, sample_rate=sr, target_sr=TOKENIZER_SR, name="prompt_audio")
    wav24 = load_audio(y, sample_rate=sr, target_sr=MEL_SR, name="prompt_audio")

Resampling uses soxr (``"VHQ"``), not ``torchaudio.transforms.Resample`` as the official ``load_wav`` does;
the two agree to within the passband ripple of their filters, not bit for bit. Every error that a caller
can fix is an :class:`~cosyvoice_triton.errors.AudioError` whose message starts with the input's name.
"""

from __future__ import annotations

import io
import math
import numbers
import os
from pathlib import Path

import numpy as np
import soundfile
import soxr

from ..errors import AudioError

__all__ = [
    "DECODE_BLOCK_FRAMES",
    "MAX_CHANNELS",
    "MAX_FILE_CHANNELS",
    "MAX_SAMPLE_RATE",
    "MAX_SECONDS",
    "MEL_SR",
    "MIN_SAMPLE_RATE",
    "MIN_SECONDS",
    "RESAMPLE_QUALITY",
    "SILENCE_PEAK",
    "SPEAKER_SR",
    "TOKENIZER_SR",
    "decode_audio",
    "decode_if_encoded",
    "load_audio",
    "resample",
    "to_mono_float32",
    "validate_audio",
    "validate_sample_rate",
]

#: Rate of the speech tokenizer's input (Whisper-style 128-bin log-mel, 100 frames/s -> 25 tokens/s).
TOKENIZER_SR = 16000
#: Rate of the CAM++ speaker encoder's input (Kaldi fbank).
SPEAKER_SR = 16000
#: Rate of the flow's prompt mel and of the HiFT output (480 samples per mel frame, 50 frames/s).
MEL_SR = 24000

#: Shortest accepted input. 0.1 s gives 10 tokenizer frames -> 3 speech tokens (one per 4 frames, i.e.
#: per 40 ms, rounded up), 5 prompt-mel frames and 8 Kaldi fbank frames: every stage gets a few units and
#: the flow at least one token, while a single short word such as "hi" (about 0.2 s) still passes. Callers
#: with stricter needs (a voice prompt should be seconds long) pass their own ``min_seconds``.
MIN_SECONDS = 0.1
#: Longest accepted input: the official ``_extract_speech_token`` asserts at most 30 s at 16 kHz (the
#: tokenizer's Whisper-style encoder has a 30 s / 3000-frame window).
MAX_SECONDS = 30.0
#: A peak below this (full scale 1.0: -80 dBFS, about three 16-bit LSBs) is digital silence, at most dither
#: or a DC offset: there are no words for the tokenizer nor a voice for the speaker encoder.
SILENCE_PEAK = 1e-4
#: Largest accepted sample magnitude: 16-bit full scale as floats; beyond it the features overflow to Inf.
MAX_PEAK = 32768.0
#: Sample rates outside [MIN_SAMPLE_RATE, MAX_SAMPLE_RATE] Hz are taken to be mistakes (4 kHz is half the
#: narrowband telephone rate; 384 kHz is the highest rate of common audio interfaces). The official
#: ``load_wav`` refuses anything below 16 kHz that needs resampling; we accept it, since band-limited
#: speech still converts (its missing high band is simply absent from the features).
MIN_SAMPLE_RATE = 4000
MAX_SAMPLE_RATE = 384000
#: soxr quality preset: "VHQ" (28-bit, linear phase) costs about 1.5x "HQ" and is still ~10 ms per 30 s.
RESAMPLE_QUALITY = "VHQ"
#: The most channels a 2-D array may have; a larger shorter axis means the layout is not [C, N] / [N, C].
MAX_CHANNELS = 64
#: The most channels an encoded file may have (7.1 surround). The model takes mono: channels are averaged.
#: A file with more is refused from its header, before anything is decoded (a few KB of many-channel silence
#: would otherwise decode to gigabytes).
MAX_FILE_CHANNELS = 8
#: Frames decoded per block: the decoder never holds more than this many multichannel frames at once.
DECODE_BLOCK_FRAMES = 1 << 16

# What decode_audio takes: an encoded file's bytes, or its path.
_BYTES = (bytes, bytearray, memoryview)
_ENCODED = (*_BYTES, str, os.PathLike)

# What libsndfile reports as the frame count of a file whose header does not say (SF_COUNT_MAX).
_UNKNOWN_FRAMES = 2**63 - 1

# Full-scale divisors of the integer PCM dtypes we accept (8-bit PCM is unsigned with offset 128).
_PCM_SCALE = {np.dtype(np.int8): 2.0**7, np.dtype(np.int16): 2.0**15, np.dtype(np.int32): 2.0**31}


def _seconds(n: int, sample_rate: float) -> str:
    return f"{n / sample_rate:.6g} s"


def _reason(exc: Exception) -> str:
    # LibsndfileError's str() embeds the repr of the BytesIO; its error_string is libsndfile's own words.
    return getattr(exc, "error_string", None) or str(exc)


def validate_sample_rate(sample_rate, *, name: str = "audio") -> int:
    """Check a sample rate and return it as ``int``.

    ``sample_rate`` may be any integer or an integral float (``22050.0``); booleans, fractional values,
    NaN and rates outside [``MIN_SAMPLE_RATE``, ``MAX_SAMPLE_RATE``] Hz raise :class:`AudioError`.
    """
    if isinstance(sample_rate, (bool, np.bool_)) or not isinstance(sample_rate, numbers.Real):
        raise AudioError(f"{name}: sample rate must be a number of Hz, got {type(sample_rate).__name__} "
                         f"{sample_rate!r}")
    value = float(sample_rate)
    if not math.isfinite(value) or value != round(value):
        raise AudioError(f"{name}: sample rate {sample_rate!r} Hz is not a whole number of Hz")
    if value <= 0:
        raise AudioError(f"{name}: sample rate {sample_rate!r} Hz must be positive")
    if not MIN_SAMPLE_RATE <= value <= MAX_SAMPLE_RATE:
        raise AudioError(f"{name}: sample rate {int(value)} Hz is outside the supported range "
                         f"{MIN_SAMPLE_RATE}..{MAX_SAMPLE_RATE} Hz")
    return int(value)


def to_mono_float32(samples, *, name: str = "audio", channel_axis: int | None = None) -> np.ndarray:
    """Convert a PCM array of any supported layout to a mono ``float32`` waveform.

    Parameters
    ----------
    samples : array_like
        1-D ``[N]``, or 2-D multichannel: ``[C, N]`` (torchaudio layout) or ``[N, C]`` (soundfile layout);
        the shorter axis is taken as channels (ties: axis 0) unless ``channel_axis`` says which, and must have at
        most ``MAX_CHANNELS`` entries.
        Floating dtypes are used as they are (full scale 1.0; louder values are kept, not clipped);
        ``int8``/``int16``/``int32`` are divided by 2**7/2**15/2**31 and ``uint8`` (8-bit WAV) is centred
        on 128 first. Other integer dtypes (int64, uint16, ...) are ambiguous and rejected.
    name : str
        Name of the input, used in error messages.

    Returns
    -------
    np.ndarray, float32, shape [N]
        Channels averaged. Shares memory with ``samples`` when that is already 1-D ``float32``.
    """
    try:
        arr = np.asarray(samples)
    except (ValueError, TypeError) as exc:
        raise AudioError(f"{name}: not an array of samples ({exc})") from exc
    dt = arr.dtype
    if dt.kind == "f":
        pass
    elif dt == np.uint8:
        arr = (arr.astype(np.float32) - 128.0) / 128.0
    elif dt in _PCM_SCALE:
        arr = (arr.astype(np.float64) / _PCM_SCALE[dt]).astype(np.float32)
    elif dt.kind in "iu":
        raise AudioError(f"{name}: {dt} samples are ambiguous; pass int16/int32 PCM or floats in [-1, 1]")
    else:
        kind = {"b": "boolean", "c": "complex"}.get(dt.kind, "non-numeric")
        raise AudioError(f"{name}: {kind} dtype {dt} is not audio; pass int16/int32 PCM or floats in [-1, 1]")

    if arr.ndim == 2:
        ch_axis = channel_axis if channel_axis is not None else 0 if arr.shape[0] <= arr.shape[1] else 1
        if arr.shape[ch_axis] > MAX_CHANNELS:
            raise AudioError(f"{name}: cannot tell channels from time in a 2-D array of shape {arr.shape}; "
                             f"expected [channels, N] or [N, channels] with at most {MAX_CHANNELS} channels")
        arr = arr.mean(axis=ch_axis, dtype=np.float64) if arr.shape[ch_axis] > 1 else arr.reshape(-1)
    elif arr.ndim != 1:
        raise AudioError(f"{name}: expected a 1-D waveform or a 2-D [channels, N] array, got a "
                         f"{arr.ndim}-D array of shape {arr.shape}")
    return np.ascontiguousarray(arr, dtype=np.float32)


class StreamChannels:
    """The channel layout of a stream of audio pieces, which belongs to the stream, not to each piece: a piece is
    1-D ``[N]`` (mono) or 2-D ``[N, C]`` frames (as a sound card or soundfile gives them); the first piece fixes
    C (or ``channels`` does) and every later piece must have as many. A piece of one stereo frame ``[1, 2]`` is
    one sample, ``[2, 2]`` two frames of two channels: never guessed from the piece's shape."""

    def __init__(self, channels: int | None = None):
        self.channels = channels

    def mono(self, piece, *, name: str = "audio piece") -> np.ndarray:
        """The piece as mono ``float32`` samples (channels averaged); :class:`AudioError` if its layout is not the
        stream's."""
        arr = np.asarray(piece) if not isinstance(piece, np.ndarray) else piece
        channels = 1 if arr.ndim == 1 else arr.shape[1] if arr.ndim == 2 else None
        if channels is not None:
            if self.channels is None:
                self.channels = channels
            elif channels != self.channels:
                raise AudioError(f"{name}: {channels} channel(s) ({'1-D' if arr.ndim == 1 else '[N, C]'} "
                                 f"{arr.shape}), but the stream's pieces have {self.channels}: a piece is [N] "
                                 "mono or [N, C] frames, the same C throughout a stream")
        return to_mono_float32(arr, name=name, channel_axis=1)


def validate_audio(
    y,
    *,
    sample_rate,
    name: str = "audio",
    min_seconds: float = MIN_SECONDS,
    max_seconds: float | None = MAX_SECONDS,
) -> np.ndarray:
    """Check that a waveform is usable and return it as mono ``float32``.

    Parameters
    ----------
    y : array_like
        Anything :func:`to_mono_float32` accepts.
    sample_rate : int or integral float
        Rate of ``y`` in Hz, checked by :func:`validate_sample_rate`.
    name : str
        Name of the input, used in error messages.
    min_seconds, max_seconds : float
        Accepted duration in seconds, inclusive; ``max_seconds=None`` means no upper limit.

    Returns
    -------
    np.ndarray, float32, shape [N]

    Raises
    ------
    AudioError
        For a bad rate, dtype or rank, and for audio that is empty, shorter than ``min_seconds``,
        longer than ``max_seconds``, contains NaN/Inf, or whose peak is below ``SILENCE_PEAK``.
        Loud or clipped audio is accepted, up to a peak of ``MAX_PEAK``.
    """
    if min_seconds < 0 or (max_seconds is not None and max_seconds < min_seconds):
        raise ValueError(f"bad duration limits: min_seconds={min_seconds}, max_seconds={max_seconds}")
    sr = validate_sample_rate(sample_rate, name=name)
    y = to_mono_float32(y, name=name)
    n = y.shape[0]
    if n == 0:
        raise AudioError(f"{name}: empty (0 samples)")
    if n < min_seconds * sr:
        raise AudioError(f"{name}: {_seconds(n, sr)} is too short; at least {min_seconds:g} s is needed")
    if max_seconds is not None and n > max_seconds * sr:
        raise AudioError(f"{name}: {_seconds(n, sr)} is too long; at most {max_seconds:g} s is accepted")
    finite = np.isfinite(y)
    if not finite.all():
        bad = np.flatnonzero(~finite)
        n_nan = int(np.isnan(y[bad]).sum())
        raise AudioError(f"{name}: {n_nan} NaN and {bad.size - n_nan} infinite samples (first at "
                         f"{_seconds(int(bad[0]), sr)}); audio must be finite")
    peak = float(np.max(np.abs(y)))
    if peak > MAX_PEAK:
        raise AudioError(f"{name}: peak {peak:.3g} is beyond {MAX_PEAK:g} (float audio is expected in [-1, 1]; "
                         f"16-bit full scale is the most accepted)")
    if peak < SILENCE_PEAK:
        raise AudioError(f"{name}: silent (peak {peak:.3g} of full scale, below {SILENCE_PEAK:g}); "
                         "digital silence cannot be converted")
    return y


def decode_audio(
    data: bytes | bytearray | memoryview | str | os.PathLike,
    *,
    name: str = "audio",
    max_seconds: float | None = None,
) -> tuple[np.ndarray, int]:
    """Decode an audio file (WAV, FLAC, OGG/Vorbis/Opus or anything else libsndfile reads) to mono.

    Parameters
    ----------
    data : bytes-like or path
        The encoded file itself (``bytes``, ``bytearray``, ``memoryview``) or a path to it.
    name : str
        Name of the input, used in error messages.
    max_seconds : float, optional
        If given, the longest accepted file: one whose header says it is longer is refused before its samples
        are decoded, and the decoding stops and refuses the file as soon as it yields more (a header may lie).

    Returns
    -------
    y : np.ndarray, float32, shape [N]
        Channels averaged; integer PCM scaled to [-1, 1). Not validated (see :func:`validate_audio`).
    sample_rate : int
        The rate stored in the file, in Hz.

    Raises
    ------
    AudioError
        For bytes libsndfile cannot read, and, from the header before any decoding, for a rate outside
        [``MIN_SAMPLE_RATE``, ``MAX_SAMPLE_RATE``] Hz, more than ``MAX_FILE_CHANNELS`` channels or more than
        ``max_seconds``. The file is decoded in blocks of ``DECODE_BLOCK_FRAMES`` frames and mixed to mono block
        by block, so the memory it costs is bounded by ``max_seconds`` of mono audio at the file's (bounded) rate,
        whatever the file claims.
    """
    if isinstance(data, _BYTES):
        if len(data) == 0:
            raise AudioError(f"{name}: empty (0 bytes)")
        source, what = io.BytesIO(bytes(data)), "the bytes are"
    elif isinstance(data, (str, os.PathLike)):
        path = Path(data)
        if not path.is_file():
            raise AudioError(f"{name}: {path}: no such file")
        source, what = path, f"{path} is"
    else:
        raise TypeError(f"{name}: expected bytes or a path, got {type(data).__name__}")
    unreadable = (RuntimeError, ValueError, OSError, EOFError)  # soundfile.LibsndfileError is a RuntimeError
    try:
        f = soundfile.SoundFile(source)
    except unreadable as exc:
        raise AudioError(f"{name}: {what} not a readable wav/flac/ogg file ({_reason(exc)})") from exc
    with f:
        sr = validate_sample_rate(f.samplerate, name=f"{name} (file header)")
        if not 1 <= f.channels <= MAX_FILE_CHANNELS:
            raise AudioError(f"{name}: the file has {f.channels} channels; at most {MAX_FILE_CHANNELS} are accepted "
                             "(they are mixed down to mono)")
        budget = None if max_seconds is None else math.floor(max_seconds * sr)
        if f.frames == _UNKNOWN_FRAMES:  # libsndfile cannot read such a file to its end (it fails seeking)
            raise AudioError(f"{name}: the file's header does not state its length (a stream written without "
                             "seeking back); write it as a complete file")
        if budget is not None and f.frames > budget:
            raise AudioError(f"{name}: {_seconds(f.frames, sr)} is too long; at most {max_seconds:g} s "
                             "is accepted")
        blocks, total = [], 0
        try:
            while True:
                want = DECODE_BLOCK_FRAMES if budget is None else min(DECODE_BLOCK_FRAMES, budget + 1 - total)
                pcm = f.read(frames=want, dtype="float32", always_2d=True)  # [n, C]
                if pcm.shape[0] == 0:
                    break
                total += pcm.shape[0]
                if budget is not None and total > budget:
                    raise AudioError(f"{name}: the file decodes to more than {max_seconds:g} s (its header says "
                                     f"{_seconds(f.frames, sr)}); at most {max_seconds:g} s is accepted")
                mono = pcm[:, 0] if pcm.shape[1] == 1 else pcm.mean(axis=1, dtype=np.float64)
                blocks.append(np.asarray(mono, dtype=np.float32).copy())
                del pcm, mono
        except AudioError:
            raise
        except unreadable as exc:
            raise AudioError(f"{name}: {what} not a readable wav/flac/ogg file ({_reason(exc)})") from exc
    y = np.concatenate(blocks) if blocks else np.zeros(0, np.float32)
    return np.ascontiguousarray(y, dtype=np.float32), int(sr)


def decode_if_encoded(
    source,
    sample_rate=None,
    *,
    name: str = "audio",
    max_seconds: float | None = MAX_SECONDS,
) -> tuple[np.ndarray, int]:
    """``(samples, sample_rate)`` of ``source``: an encoded file is decoded (its header has the rate), an
    array is returned as it is with ``sample_rate``, which it requires (encoded files must not get one).

    Lets a caller that needs one input at several rates decode it once; nothing is validated here beyond
    what :func:`decode_audio` checks.
    """
    if isinstance(source, _ENCODED):
        if sample_rate is not None:
            raise ValueError(f"{name}: sample_rate is only for arrays; an encoded file carries its own rate")
        return decode_audio(source, name=name, max_seconds=max_seconds)
    if sample_rate is None:
        raise ValueError(f"{name}: sample_rate is required when passing an array of samples")
    return source, sample_rate


def resample(
    y: np.ndarray,
    *,
    orig_sr,
    target_sr,
    quality: str = RESAMPLE_QUALITY,
) -> np.ndarray:
    """Resample a mono waveform with soxr.

    Parameters
    ----------
    y : np.ndarray, float, shape [N]
    orig_sr, target_sr : int or integral float
        Rates in Hz.
    quality : str
        soxr preset, ``"HQ"`` or ``"VHQ"``.

    Returns
    -------
    np.ndarray, float32, shape [floor(N * target_sr / orig_sr + 1/2)]
        ``y`` itself (as float32) when the rates are equal.
    """
    orig = validate_sample_rate(orig_sr, name="resample: orig_sr")
    target = validate_sample_rate(target_sr, name="resample: target_sr")
    if quality not in ("HQ", "VHQ"):
        raise ValueError(f"resample: quality must be 'HQ' or 'VHQ', got {quality!r}")
    y = np.asarray(y)
    if y.ndim != 1 or y.dtype.kind != "f":
        raise AudioError(f"resample: expected a 1-D float waveform, got {y.ndim}-D {y.dtype} "
                         "(use to_mono_float32 first)")
    y = np.ascontiguousarray(y, dtype=np.float32)
    if orig == target or y.size == 0:
        return y
    return np.ascontiguousarray(soxr.resample(y, orig, target, quality=quality), dtype=np.float32)


def load_audio(
    source,
    *,
    target_sr,
    sample_rate=None,
    name: str = "audio",
    min_seconds: float = MIN_SECONDS,
    max_seconds: float | None = MAX_SECONDS,
) -> np.ndarray:
    """Decode (or take) a waveform, validate it at its own rate and resample it to ``target_sr``.

    Parameters
    ----------
    source : bytes-like, path, or array_like
        An encoded file (see :func:`decode_audio`) or samples (see :func:`to_mono_float32`).
    target_sr : int
        Output rate in Hz, e.g. ``TOKENIZER_SR`` or ``MEL_SR``.
    sample_rate : int, optional
        Rate of ``source`` in Hz: required for arrays, must be omitted for files (their header has it).
    name, min_seconds, max_seconds
        As in :func:`validate_audio`; the duration is checked before resampling.

    Returns
    -------
    np.ndarray, float32, shape [N'] at ``target_sr``
    """
    y, sample_rate = decode_if_encoded(source, sample_rate, name=name, max_seconds=max_seconds)
    y = validate_audio(y, sample_rate=sample_rate, name=name, min_seconds=min_seconds, max_seconds=max_seconds)
    return resample(y, orig_sr=sample_rate, target_sr=target_sr)
