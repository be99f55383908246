"""The three acoustic features of the CosyVoice2 front end, exact and batched.

- :func:`cosyvoice_mel`: the flow's prompt feature (and HiFT's input), official
  ``matcha.utils.audio.mel_spectrogram(y, **feat_extractor)``; 24 kHz in, ``[T, 80]`` out, T = N // 480.
- :func:`whisper_log_mel`: the speech tokenizer v2 input, official
  ``whisper.log_mel_spectrogram(y, n_mels=128)``; 16 kHz in, ``[128, T]`` out, T = N // 160.
- :func:`kaldi_fbank`: the CAM++ speaker encoder input, official ``torchaudio.compliance.kaldi.fbank(y,
  num_mel_bins=80, dither=0, sample_frequency=16000)`` minus its mean over time; 16 kHz in, ``[T, 80]``
  out, T = 1 + (N - 400) // 160.

Inputs are 1-D float waveforms on the [-1, 1] full scale (what :mod:`cosyvoice_triton.frontend.audio` returns; the
official front end feeds float audio from ``torchaudio.load`` to all three, never int16-scaled values).
The ``*_batch`` variants take a list of such waveforms of any lengths and return zero-padded features plus
their lengths (``int32``). Each utterance is computed on its own, so padding never changes a value and
batched output equals the one-by-one output exactly; the Whisper floor (max - 8) in particular is taken per
utterance, as the official per-prompt call does.

The mel and Whisper features are computed here in float64 numpy (the references compute in float32 torch,
which agrees to about 1e-6 relative); the fbank uses ``kaldi-native-fbank`` with every option set to
torchaudio's defaults.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence

import kaldi_native_fbank as knf
import librosa
import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from ..config import MelConfig
from ..errors import AudioError
from .audio import MEL_SR, SPEAKER_SR, TOKENIZER_SR, validate_sample_rate

__all__ = [
    "WHISPER_HOP",
    "WHISPER_N_FFT",
    "cosyvoice_mel",
    "cosyvoice_mel_batch",
    "kaldi_fbank",
    "kaldi_fbank_batch",
    "kaldi_fbank_options",
    "mel_basis",
    "pad_batch",
    "whisper_log_mel",
    "whisper_log_mel_batch",
    "whisper_mel_filters",
]

#: Whisper's STFT: 25 ms periodic-Hann frames every 10 ms at 16 kHz.
WHISPER_N_FFT = 400
WHISPER_HOP = 160
_WHISPER_N_MELS = (80, 128)  # the two filter banks whisper ships (mel_filters.npz)

_FBANK_FRAME = 400  # 25 ms at 16 kHz: the shortest input with one frame (snip_edges)

# ----------------------------------------------------------------------------------------------- helpers


def _check_rate(sample_rate, expected: int, what: str) -> None:
    sr = validate_sample_rate(sample_rate, name=what)
    if sr != expected:
        raise AudioError(f"{what}: needs {expected} Hz audio, got {sr} Hz; resample it first "
                         "(cosyvoice_triton.frontend.audio.resample)")


def _waveform(y, *, name: str, min_samples: int, what: str) -> np.ndarray:
    """``y`` as a 1-D finite float array with at least ``min_samples`` samples (dtype unchanged).

    The minimum mirrors the official code: torch.stft(center=True) and F.pad(mode="reflect") refuse a
    reflect pad >= the signal length, where numpy would silently reflect twice."""
    arr = np.asarray(y)
    if arr.ndim != 1:
        raise AudioError(f"{name}: {what} needs a 1-D waveform, got an array of shape {arr.shape}")
    if arr.dtype.kind != "f":
        raise AudioError(f"{name}: {what} needs float samples in [-1, 1], got {arr.dtype} "
                         "(convert with cosyvoice_triton.frontend.audio.to_mono_float32)")
    if arr.shape[0] < min_samples:
        raise AudioError(f"{name}: {arr.shape[0]} samples are too few for {what}; at least {min_samples} "
                         "are needed")
    if not np.isfinite(arr).all():
        raise AudioError(f"{name}: {what} needs finite samples; the waveform contains NaN or Inf")
    return arr


def _utterances(waves, what: str) -> list:
    if isinstance(waves, np.ndarray) and waves.ndim == 1:
        raise ValueError(f"{what}: expected a list of 1-D waveforms, got one 1-D array "
                         "(use the single-utterance function, or wrap it in a list)")
    if not isinstance(waves, Iterable) or isinstance(waves, (str, bytes)):
        raise TypeError(f"{what}: expected a list of 1-D waveforms, got {type(waves).__name__}")
    waves = list(waves)
    if not waves:
        raise ValueError(f"{what}: the batch is empty")
    return waves


def pad_batch(feats: Sequence[np.ndarray], time_axis: int) -> tuple[np.ndarray, np.ndarray]:
    """Stack arrays that differ only along ``time_axis`` into one zero-padded ``float32`` batch.

    Returns ``(padded [B, *shape with time_axis at its longest], lengths int32 [B])``.
    """
    lengths = np.array([f.shape[time_axis] for f in feats], dtype=np.int32)
    shape = list(feats[0].shape)
    shape[time_axis] = int(lengths.max())
    out = np.zeros((len(feats), *shape), dtype=np.float32)
    for b, f in enumerate(feats):
        index = [slice(None)] * f.ndim
        index[time_axis] = slice(0, f.shape[time_axis])
        out[(b, *index)] = f
    return out, lengths


def _readonly(a: np.ndarray) -> np.ndarray:
    a.setflags(write=False)
    return a


# ------------------------------------------------------------------------------------- CosyVoice mel


def _check_mel_config(cfg: MelConfig) -> None:
    if not (cfg.n_fft > 0 and cfg.hop_size > 0 and 0 < cfg.win_size <= cfg.n_fft and cfg.num_mels > 0):
        raise ValueError(f"bad MelConfig: need n_fft, hop_size, num_mels > 0 and win_size in 1..n_fft: {cfg}")
    if cfg.fmax is not None and not 0 <= cfg.fmin < cfg.fmax <= cfg.sampling_rate / 2:
        raise ValueError(f"bad MelConfig: need 0 <= fmin < fmax <= sampling_rate / 2: {cfg}")


@functools.lru_cache(maxsize=8)
def _mel_tables(cfg: MelConfig) -> tuple[np.ndarray, np.ndarray]:
    """(window float64 [n_fft], basis float64 [num_mels, n_fft // 2 + 1]) of one config."""
    _check_mel_config(cfg)
    # torch.hann_window(win_size) is periodic; torch.stft zero-pads a shorter window to n_fft, centred.
    n = np.arange(cfg.win_size)
    window = np.zeros(cfg.n_fft)
    left = (cfg.n_fft - cfg.win_size) // 2
    window[left:left + cfg.win_size] = 0.5 - 0.5 * np.cos(2.0 * np.pi * n / cfg.win_size)
    basis = mel_basis(cfg).astype(np.float64)
    return _readonly(window), _readonly(basis)


@functools.lru_cache(maxsize=8)
def _mel_basis_cached(cfg: MelConfig) -> np.ndarray:
    _check_mel_config(cfg)
    basis = librosa.filters.mel(sr=cfg.sampling_rate, n_fft=cfg.n_fft, n_mels=cfg.num_mels, fmin=cfg.fmin,
                                fmax=cfg.fmax, htk=False, norm="slaney", dtype=np.float32)
    return _readonly(basis)


def mel_basis(config: MelConfig | None = None) -> np.ndarray:
    """The librosa slaney mel filter bank of the CosyVoice mel, ``float32 [num_mels, n_fft // 2 + 1]``
    (``[80, 961]`` for the release), read-only and cached per config."""
    return _mel_basis_cached(config or MelConfig())


def _mel_geometry(cfg: MelConfig) -> tuple[int, int, int]:
    """(reflect pad, extra centre pad, minimum samples) of the matcha mel."""
    pad = int((cfg.n_fft - cfg.hop_size) / 2)
    centre = cfg.n_fft // 2 if cfg.center else 0
    min_samples = max(pad + 1, cfg.n_fft - 2 * pad - 2 * centre, centre + 1 - 2 * pad, 1)
    return pad, centre, min_samples


def _cosyvoice_mel_one(y: np.ndarray, cfg: MelConfig, pad: int, centre: int) -> np.ndarray:
    window, basis = _mel_tables(cfg)
    yp = np.pad(y.astype(np.float64), pad, mode="reflect")
    if centre:
        yp = np.pad(yp, centre, mode="reflect")
    frames = sliding_window_view(yp, cfg.n_fft)[:: cfg.hop_size]  # [T, n_fft], a view
    spec = np.fft.rfft(frames * window, axis=-1)  # [T, n_fft // 2 + 1]
    magnitude = np.sqrt(spec.real**2 + spec.imag**2 + 1e-9)
    return np.log(np.maximum(magnitude @ basis.T, 1e-5)).astype(np.float32)  # [T, num_mels]


def cosyvoice_mel(y, *, sample_rate=MEL_SR, config: MelConfig | None = None) -> np.ndarray:
    """The flow's log-mel of one utterance (``matcha.utils.audio.mel_spectrogram``).

    Reflect-pad ``int((n_fft - hop) / 2)`` samples each side, frame with a periodic Hann window (no further
    centring unless ``config.center``), magnitude ``sqrt(re² + im² + 1e-9)``, slaney mel bank, natural
    ``log(max(x, 1e-5))``.

    Parameters
    ----------
    y : np.ndarray, float, shape [N]
        Waveform at ``config.sampling_rate`` (24 kHz), full scale 1.0; N > 720 for the release config.
    sample_rate : int
        Rate of ``y`` in Hz; must equal ``config.sampling_rate``.
    config : MelConfig, optional
        Defaults to the CosyVoice2 release (n_fft 1920, hop 480, 80 mels, fmax 8 kHz).

    Returns
    -------
    np.ndarray, float32, shape [T, num_mels]
        Natural-log magnitudes, ``T = N // 480`` for the release config (frame-major, as the flow's
        ``prompt_feat`` takes it; the official ``feat_extractor`` returns the transpose).
    """
    cfg = config or MelConfig()
    _waveform(y, name="y", min_samples=_mel_geometry(cfg)[2], what="cosyvoice_mel")
    feats, _ = cosyvoice_mel_batch([y], sample_rate=sample_rate, config=cfg)
    return feats[0]


def cosyvoice_mel_batch(
    waves, *, sample_rate=MEL_SR, config: MelConfig | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`cosyvoice_mel` of several utterances.

    Returns
    -------
    feats : np.ndarray, float32, shape [B, T_max, num_mels]
        Frames past an utterance's length are 0.0.
    lengths : np.ndarray, int32, shape [B]
        Frames of each utterance.
    """
    cfg = config or MelConfig()
    _check_rate(sample_rate, cfg.sampling_rate, "cosyvoice_mel")
    pad, centre, min_samples = _mel_geometry(cfg)
    feats = [
        _cosyvoice_mel_one(_waveform(y, name=f"waves[{b}]", min_samples=min_samples, what="cosyvoice_mel"),
                           cfg, pad, centre)
        for b, y in enumerate(_utterances(waves, "cosyvoice_mel_batch"))
    ]
    return pad_batch(feats, time_axis=0)


# ---------------------------------------------------------------------------------------- Whisper mel


@functools.lru_cache(maxsize=2)
def _whisper_filters_cached(n_mels: int) -> np.ndarray:
    # whisper's assets/mel_filters.npz holds exactly librosa.filters.mel(sr=16000, n_fft=400, n_mels=n).
    basis = librosa.filters.mel(sr=TOKENIZER_SR, n_fft=WHISPER_N_FFT, n_mels=n_mels, dtype=np.float32)
    return _readonly(basis)


def whisper_mel_filters(n_mels: int = 128) -> np.ndarray:
    """Whisper's mel filter bank, ``float32 [n_mels, 201]`` (librosa slaney, 16 kHz, n_fft 400), read-only."""
    if n_mels not in _WHISPER_N_MELS:
        raise ValueError(f"whisper has mel filters for n_mels in {_WHISPER_N_MELS}, not {n_mels}")
    return _whisper_filters_cached(n_mels)


@functools.lru_cache(maxsize=2)
def _whisper_tables(n_mels: int) -> tuple[np.ndarray, np.ndarray]:
    """(periodic Hann window float64 [400], filters float64 [n_mels, 201])."""
    n = np.arange(WHISPER_N_FFT)
    window = 0.5 - 0.5 * np.cos(2.0 * np.pi * n / WHISPER_N_FFT)
    return _readonly(window), _readonly(whisper_mel_filters(n_mels).astype(np.float64))


def _whisper_log_mel_one(y: np.ndarray, window: np.ndarray, filters: np.ndarray) -> np.ndarray:
    yp = np.pad(y.astype(np.float64), WHISPER_N_FFT // 2, mode="reflect")  # torch.stft(center=True)
    frames = sliding_window_view(yp, WHISPER_N_FFT)[::WHISPER_HOP][:-1]  # whisper drops the last frame
    spec = np.fft.rfft(frames * window, axis=-1)  # [T, 201]
    power = spec.real**2 + spec.imag**2
    log_spec = np.log10(np.maximum(power @ filters.T, 1e-10))  # [T, n_mels]
    log_spec = np.maximum(log_spec, log_spec.max() - 8.0)
    return ((log_spec + 4.0) / 4.0).T.astype(np.float32)  # [n_mels, T]


def whisper_log_mel(y, *, sample_rate=TOKENIZER_SR, n_mels: int = 128) -> np.ndarray:
    """The speech tokenizer's input for one utterance (``whisper.log_mel_spectrogram(y, n_mels)``).

    STFT with n_fft 400, hop 160, periodic Hann, centred with reflect padding; power spectrum without
    the last frame; librosa slaney mel bank; ``log10(max(x, 1e-10))``, floored at (its max - 8), then
    ``(x + 4) / 4``.

    Parameters
    ----------
    y : np.ndarray, float, shape [N]
        16 kHz waveform, full scale 1.0, N > 200.
    sample_rate : int
        Rate of ``y`` in Hz; must be 16000.
    n_mels : int
        128 (tokenizer v2, CosyVoice2) or 80.

    Returns
    -------
    np.ndarray, float32, shape [n_mels, N // 160]
        Values in roughly [-1.5, 1.5]; the dynamic range is at most 2.0 (8 decades / 4).
    """
    _waveform(y, name="y", min_samples=WHISPER_N_FFT // 2 + 1, what="whisper_log_mel")
    feats, _ = whisper_log_mel_batch([y], sample_rate=sample_rate, n_mels=n_mels)
    return feats[0]


def whisper_log_mel_batch(
    waves, *, sample_rate=TOKENIZER_SR, n_mels: int = 128
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`whisper_log_mel` of several utterances, each floored at its own maximum.

    Returns
    -------
    feats : np.ndarray, float32, shape [B, n_mels, T_max]
        Frames past an utterance's length are 0.0.
    lengths : np.ndarray, int32, shape [B]
        ``N_b // 160``, the tokenizer's ``feats_length`` input.
    """
    _check_rate(sample_rate, TOKENIZER_SR, "whisper_log_mel")
    window, filters = _whisper_tables(n_mels)
    feats = [
        _whisper_log_mel_one(
            _waveform(y, name=f"waves[{b}]", min_samples=WHISPER_N_FFT // 2 + 1, what="whisper_log_mel"),
            window, filters)
        for b, y in enumerate(_utterances(waves, "whisper_log_mel_batch"))
    ]
    return pad_batch(feats, time_axis=1)


# --------------------------------------------------------------------------------------- Kaldi fbank


def kaldi_fbank_options(*, num_mel_bins: int = 80, sample_rate: int = SPEAKER_SR) -> knf.FbankOptions:
    """``kaldi-native-fbank`` options equal to ``torchaudio.compliance.kaldi.fbank``'s defaults with
    ``dither=0``. Every field is set, because several knf defaults differ from torchaudio's
    (knf: ``dither=3e-5``, ``num_bins=23``)."""
    opts = knf.FbankOptions()
    frame = opts.frame_opts
    frame.samp_freq = float(sample_rate)
    frame.frame_length_ms = 25.0
    frame.frame_shift_ms = 10.0
    frame.dither = 0.0  # CosyVoice passes dither=0
    frame.preemph_coeff = 0.97
    frame.remove_dc_offset = True
    frame.window_type = "povey"
    frame.round_to_power_of_two = True  # 400-sample frames -> 512-point FFT
    frame.blackman_coeff = 0.42
    frame.snip_edges = True
    mel = opts.mel_opts
    mel.num_bins = num_mel_bins
    mel.low_freq = 20.0
    mel.high_freq = 0.0  # <= 0 means nyquist + high_freq
    mel.vtln_low = 100.0
    mel.vtln_high = -500.0
    mel.debug_mel = False
    mel.htk_mode = False
    mel.is_librosa = False  # Kaldi's triangular banks on the 1127 ln(1 + f/700) mel scale
    opts.use_energy = False
    opts.energy_floor = 0.0
    opts.raw_energy = True
    opts.htk_compat = False
    opts.use_log_fbank = True
    opts.use_power = True
    opts.use_log_floor = True  # log(max(x, eps)), as torchaudio
    opts.eps = float(np.finfo(np.float32).eps)
    return opts


@functools.lru_cache(maxsize=4)
def _fbank_options_cached(num_mel_bins: int, sample_rate: int) -> knf.FbankOptions:
    if num_mel_bins < 3:
        raise ValueError(f"kaldi_fbank: num_mel_bins must be at least 3, got {num_mel_bins}")
    opts = kaldi_fbank_options(num_mel_bins=num_mel_bins, sample_rate=sample_rate)
    try:
        knf.OnlineFbank(opts)  # knf checks that no mel band is empty (at 16 kHz: num_mel_bins <= 126)
    except ValueError as exc:
        raise ValueError(f"kaldi_fbank: num_mel_bins={num_mel_bins} is too many for {sample_rate} Hz audio "
                         f"and a 512-point FFT ({exc})") from exc
    return opts


def _kaldi_fbank_one(y: np.ndarray, opts: knf.FbankOptions, subtract_mean: bool) -> np.ndarray:
    fbank = knf.OnlineFbank(opts)  # copies opts
    fbank.accept_waveform(opts.frame_opts.samp_freq, np.ascontiguousarray(y, dtype=np.float32))
    fbank.input_finished()
    feats = np.stack([fbank.get_frame(i) for i in range(fbank.num_frames_ready)]).astype(np.float32)
    if subtract_mean:
        feats = (feats - feats.mean(axis=0, dtype=np.float64)).astype(np.float32)
    return feats


def kaldi_fbank(
    y, *, sample_rate=SPEAKER_SR, num_mel_bins: int = 80, subtract_mean: bool = True
) -> np.ndarray:
    """The CAM++ speaker encoder's input for one utterance.

    Kaldi fbank as ``torchaudio.compliance.kaldi.fbank(y, num_mel_bins=80, dither=0,
    sample_frequency=16000)``: 25 ms povey-windowed frames every 10 ms (snip_edges), DC removal,
    pre-emphasis 0.97, 512-point power spectrum, Kaldi mel banks 20 Hz..8 kHz, ``log(max(x, FLT_EPSILON))``;
    then, as the official front end does, minus its mean over time.

    Parameters
    ----------
    y : np.ndarray, float, shape [N]
        16 kHz waveform, full scale 1.0 (not int16-scaled: the mean subtraction cancels the scale except
        where the log floor is hit), N >= 400.
    sample_rate : int
        Rate of ``y`` in Hz; must be 16000.
    num_mel_bins : int
        80 for CAM++.
    subtract_mean : bool
        Subtract the per-bin mean over frames (CosyVoice's ``feat - feat.mean(dim=0)``).

    Returns
    -------
    np.ndarray, float32, shape [1 + (N - 400) // 160, num_mel_bins]
        Natural-log mel energies (mean-normalised unless ``subtract_mean=False``).
    """
    _waveform(y, name="y", min_samples=_FBANK_FRAME, what="kaldi_fbank")
    feats, _ = kaldi_fbank_batch([y], sample_rate=sample_rate, num_mel_bins=num_mel_bins,
                                 subtract_mean=subtract_mean)
    return feats[0]


def kaldi_fbank_batch(
    waves, *, sample_rate=SPEAKER_SR, num_mel_bins: int = 80, subtract_mean: bool = True
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`kaldi_fbank` of several utterances, each mean-normalised over its own frames.

    Returns
    -------
    feats : np.ndarray, float32, shape [B, T_max, num_mel_bins]
        Frames past an utterance's length are 0.0.
    lengths : np.ndarray, int32, shape [B]
    """
    _check_rate(sample_rate, SPEAKER_SR, "kaldi_fbank")
    opts = _fbank_options_cached(num_mel_bins, SPEAKER_SR)
    feats = [
        _kaldi_fbank_one(_waveform(y, name=f"waves[{b}]", min_samples=_FBANK_FRAME, what="kaldi_fbank"),
                         opts, subtract_mean)
        for b, y in enumerate(_utterances(waves, "kaldi_fbank_batch"))
    ]
    return pad_batch(feats, time_axis=0)
