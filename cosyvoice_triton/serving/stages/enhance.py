"""Optional front-end clean-up, each off by default and switched by a ``preprocess`` config parameter.

* :class:`VadTrimmer` (``vad_trim``): cut leading and trailing non-speech from the source and the prompt with
  Silero VAD. The model ships inside the ``silero-vad`` PyPI package (its ONNX file, run on onnxruntime); the
  package imports without torchaudio, which it only needs for its file helpers (not used here). A clip in
  which no speech is found is refused (:class:`~cosyvoice_triton.errors.AudioError`).
* :func:`spectral_gate` (``denoise_prompt``): stationary spectral gating of the prompt, so that background
  noise is not taken for part of the voice: the noise floor per frequency is estimated from the quietest
  frames and everything within ``n_std`` deviations of it is attenuated (smoothed mask, STFT overlap-add).
"""

from __future__ import annotations

import numpy as np
from scipy.ndimage import uniform_filter

from ...errors import AudioError
from ...frontend import audio

__all__ = ["VAD_REQUIREMENT", "VadTrimmer", "spectral_gate"]

VAD_REQUIREMENT = "silero-vad==6.2.3"
_VAD_SR = 16000


class VadTrimmer:
    """Trim non-speech at both ends; ``pad_seconds`` of margin are kept around the detected speech."""

    def __init__(self, *, threshold: float = 0.5, pad_seconds: float = 0.1):
        try:
            import torch  # noqa: F401  (silero's wrapper takes torch tensors)
            from silero_vad import get_speech_timestamps, load_silero_vad
        except ImportError as exc:
            raise ImportError(f"vad_trim needs the silero-vad package: pip install {VAD_REQUIREMENT} ({exc})") from exc
        if not 0 < threshold < 1 or pad_seconds < 0:
            raise ValueError(f"vad threshold must be in (0, 1) and pad >= 0, got {threshold}, {pad_seconds}")
        self._model = load_silero_vad(onnx=True)
        self._timestamps = get_speech_timestamps
        self.threshold, self.pad_seconds = float(threshold), float(pad_seconds)

    def speech_span(self, y: np.ndarray, sr: int) -> tuple[int, int] | None:
        """(start, end) sample indices of the speech in ``y`` at rate ``sr``, or None when there is none."""
        import torch

        y16 = audio.resample(np.asarray(y, np.float32), orig_sr=sr, target_sr=_VAD_SR)
        stamps = self._timestamps(torch.from_numpy(y16), self._model, sampling_rate=_VAD_SR,
                                  threshold=self.threshold)
        if not stamps:
            return None
        scale = sr / _VAD_SR
        pad = round(self.pad_seconds * sr)
        start = max(0, int(stamps[0]["start"] * scale) - pad)
        end = min(len(y), int(np.ceil(stamps[-1]["end"] * scale)) + pad)
        return start, end

    def trim(self, y: np.ndarray, sr: int, *, name: str = "audio") -> np.ndarray:
        span = self.speech_span(y, sr)
        if span is None:
            raise AudioError(f"{name}: no speech detected (voice activity detection found none)")
        return np.ascontiguousarray(y[span[0]:span[1]])


def spectral_gate(y: np.ndarray, sr: int, *, n_std: float = 1.5, reduction: float = 0.9,
                  noise_quantile: float = 0.15) -> np.ndarray:
    """Stationary noise reduction; returns float32 of the same length. ``reduction``: how much of a gated
    bin is removed (1.0: all)."""
    import librosa

    y = np.asarray(y, np.float32)
    n_fft = int(2 ** np.round(np.log2(0.032 * sr)))
    hop = n_fft // 4
    if y.size < n_fft:
        return y
    spec = librosa.stft(y, n_fft=n_fft, hop_length=hop)
    db = 20 * np.log10(np.abs(spec) + 1e-10)
    energy = db.mean(axis=0)
    quiet = energy <= np.quantile(energy, noise_quantile)
    threshold = db[:, quiet].mean(axis=1) + n_std * db[:, quiet].std(axis=1)
    mask = (db > threshold[:, None]).astype(np.float32)
    mask = uniform_filter(mask, size=(3, 5), mode="nearest")  # no musical-noise speckles
    gain = 1.0 - reduction * (1.0 - mask)
    out = librosa.istft(spec * gain, hop_length=hop, length=y.size)
    return np.ascontiguousarray(out, dtype=np.float32)
