"""``postprocess``: the served waveform's rate, optional loudness normalisation, optional encoded bytes.

All switched by the model's config parameters (read once): ``output_sample_rate`` (0: the model's 24 kHz),
``loudness_lufs`` (0: off; else the ITU-R BS.1770-4 integrated loudness is brought to that target, the gain
capped so that the peak stays at or below ``peak_dbfs``), ``output_format`` (``""``: no bytes; ``wav`` /
``flac``: 16-bit PCM file bytes in the extra output ``audio_bytes``).

Streamed answers (:meth:`Postprocessor.stream`, one :class:`ChunkPostprocessor` per stream) get what can be done
causally: the output rate, by one soxr ``ResampleStream`` per stream at the quality of the whole-answer path
(VHQ), which carries the filter state across chunk boundaries, so the chunks joined equal the whole answer
resampled at once (bit for bit here: soxr's one-shot call runs the same engine). It holds back the filter's
delay (~60 ms of audio) until the next chunk and gives it out with the last one. Not applied to streams:
loudness normalisation (its gain comes from the integrated loudness, gated over every 400 ms block of the whole
utterance, and from its peak: unknown until the last chunk, and a gain that changed as the utterance went on
would be an AGC, not the same output) and ``output_format`` (a file container of the whole answer; streamed
chunks are float32 samples, the client writes the file).
"""

from __future__ import annotations

import io
import math
from collections.abc import Iterable, Iterator

import numpy as np
import pyloudnorm
import soundfile
import soxr

from ...frontend import audio
from ...shapes import GRAPHS, SAMPLES_PER_MEL_FRAME
from .batching import ItemResult, RequestError, run_per_item

__all__ = ["OUTPUT_FORMATS", "ChunkPostprocessor", "Postprocessor", "integrated_loudness"]

OUTPUT_FORMATS = ("", "wav", "flac")
#: The longest waveform ``postprocess`` takes: what HiFT gives for its most mel frames.
MAX_SAMPLES = GRAPHS["hift_decoder"].axes["mel_frames"].max * SAMPLES_PER_MEL_FRAME


def integrated_loudness(y: np.ndarray, sr: int) -> float:
    """BS.1770-4 integrated loudness (LUFS) of a mono signal; ``-inf`` for silence or < 0.4 s.

    pyloudnorm's meter with its ``DeMan`` K-weighting, which derives the filters for any rate from the analog
    prototypes and so reproduces the standard's 48 kHz coefficients (a 997 Hz sine at -20 dBFS reads -23.01 LUFS);
    pyloudnorm's default ``K-weighting`` class reads 0.04-0.12 LU off at 16-48 kHz."""
    y = np.asarray(y, dtype=np.float64).reshape(-1)
    if y.size < 0.4 * sr:  # the meter refuses audio shorter than one gating block
        return float("-inf")
    return float(pyloudnorm.Meter(int(sr), filter_class="DeMan").integrated_loudness(y))


class Postprocessor:
    def __init__(self, *, model_sample_rate: int = audio.MEL_SR, output_sample_rate: int = 0,
                 loudness_lufs: float = 0.0, peak_dbfs: float = -1.0, output_format: str = ""):
        self.model_sample_rate = int(model_sample_rate)
        self.output_sample_rate = int(output_sample_rate) or self.model_sample_rate
        audio.validate_sample_rate(self.output_sample_rate, name="output_sample_rate")
        if loudness_lufs > 0 or (loudness_lufs and not -70 < loudness_lufs < 0):
            raise ValueError(f"loudness_lufs must be 0 (off) or in (-70, 0), got {loudness_lufs}")
        if peak_dbfs > 0:
            raise ValueError(f"peak_dbfs must be <= 0, got {peak_dbfs}")
        if output_format not in OUTPUT_FORMATS:
            raise ValueError(f"output_format must be one of {OUTPUT_FORMATS}, got {output_format!r}")
        self.loudness_lufs, self.peak = float(loudness_lufs), 10 ** (peak_dbfs / 20)
        self.output_format = output_format

    def waveform(self, wave: np.ndarray) -> np.ndarray:
        """The model's 24 kHz waveform -> the served one (float32, output rate, loudness)."""
        y = np.asarray(wave, dtype=np.float32).reshape(-1)
        if self.output_sample_rate != self.model_sample_rate:
            y = audio.resample(y, orig_sr=self.model_sample_rate, target_sr=self.output_sample_rate)
        return self.normalize(y)

    def normalize(self, y: np.ndarray) -> np.ndarray:
        """Loudness normalisation (``loudness_lufs``, the gain capped at ``peak_dbfs``) of a whole waveform
        already at the output rate; float32, unchanged when it is off or the waveform is silent / < 0.4 s."""
        y = np.asarray(y, dtype=np.float32).reshape(-1)
        if self.loudness_lufs:
            loud = integrated_loudness(y, self.output_sample_rate)
            if math.isfinite(loud):
                gain = 10 ** ((self.loudness_lufs - loud) / 20)
                peak = float(np.max(np.abs(y))) if y.size else 0.0
                if peak * gain > self.peak:
                    gain = self.peak / peak
                y = (y * gain).astype(np.float32)
        return np.ascontiguousarray(y, dtype=np.float32)

    def stream(self) -> ChunkPostprocessor:
        """The post-processing of one streamed answer (see the module docstring: the output rate only)."""
        return ChunkPostprocessor(self.model_sample_rate, self.output_sample_rate)

    @property
    def not_streamed(self) -> list[str]:
        """The configured options that streamed answers do not get (see the module docstring), for the log."""
        return [f"{k}={v!r}" for k, v in (("loudness_lufs", self.loudness_lufs),
                                          ("output_format", self.output_format)) if v]

    def batch(self, waves) -> list[ItemResult[dict[str, np.ndarray]]]:
        """The ``postprocess`` outputs of each request: ``waveform [1, N]``, ``sample_rate [1, 1]`` and, with an
        ``output_format``, ``audio_bytes [1, 1]``."""
        def one(w):
            if w is None:
                raise RequestError("postprocess: missing input 'waveform'")
            w = np.asarray(w)
            if w.ndim != 2 or w.shape[0] != 1 or w.dtype.kind != "f":
                raise RequestError(f"postprocess: waveform must be [1, N] float, got {w.dtype} {list(w.shape)}")
            if w.shape[1] > MAX_SAMPLES:
                raise RequestError(f"postprocess: waveform axis samples = {w.shape[1]} exceeds the maximum "
                                   f"{MAX_SAMPLES} (the vocoder's longest output)")
            if not np.isfinite(w).all():
                raise RequestError("postprocess: waveform has NaN/Inf values; inputs must be finite")
            y = self.waveform(w)
            out = {"waveform": y[None], "sample_rate": np.array([[self.output_sample_rate]], np.int32)}
            if self.output_format:
                out["audio_bytes"] = np.array([[self.encode(y)]], dtype=object)
            return out

        return run_per_item(waves, one)

    def encode(self, y: np.ndarray) -> bytes:
        """16-bit PCM file bytes of ``y`` (``output_format``), or b'' when no format is set."""
        if not self.output_format:
            return b""
        buf = io.BytesIO()
        soundfile.write(buf, np.clip(y, -1.0, 1.0), self.output_sample_rate, subtype="PCM_16",
                        format=self.output_format.upper())
        return buf.getvalue()


class ChunkPostprocessor:
    """Post-processing of one stream's chunks, in order: ``__call__(chunk, last=...)`` -> the served chunk.

    Resamples from ``model_sample_rate`` to ``output_sample_rate`` with one soxr ``ResampleStream`` (state kept
    across chunks; ``last=True`` flushes the held-back tail). A chunk may come out shorter than its share
    (the filter's delay), never a sample is lost: the joined chunks equal :meth:`Postprocessor.waveform`'s
    resampling of the joined input. Equal rates: chunks pass unchanged (as float32)."""

    def __init__(self, model_sample_rate: int, output_sample_rate: int, quality: str = audio.RESAMPLE_QUALITY):
        self.model_sample_rate, self.sample_rate = int(model_sample_rate), int(output_sample_rate)
        self._resampler = None
        if self.sample_rate != self.model_sample_rate:
            self._resampler = soxr.ResampleStream(self.model_sample_rate, self.sample_rate, 1, dtype="float32",
                                                  quality=quality)
        self.done = False

    def __call__(self, chunk: np.ndarray, *, last: bool) -> np.ndarray:
        if self.done:
            raise RuntimeError("ChunkPostprocessor: a chunk after the last one")
        self.done = bool(last)
        y = np.ascontiguousarray(np.asarray(chunk, dtype=np.float32).reshape(-1))
        if self._resampler is not None:
            y = np.ascontiguousarray(self._resampler.resample_chunk(y, last=bool(last)), dtype=np.float32)
        return y

    def run(self, chunks: Iterable[tuple[np.ndarray, bool]]) -> Iterator[np.ndarray]:
        """The served chunks of ``(chunk, last)`` pairs, as they come; a chunk the filter's delay swallowed
        whole (empty, not the last) is skipped."""
        for chunk, last in chunks:
            y = self(chunk, last=last)
            if y.size or last:
                yield y
