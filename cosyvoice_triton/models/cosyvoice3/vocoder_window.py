"""CosyVoice3's causal vocoder over a bounded mel window, for streams of any length.

The official streaming ``token2wav`` runs the vocoder on every mel frame so far at each chunk: the cost of a chunk
grows with the stream, and so does the memory (the vocoder's NSF noise buffer holds 300 s).
:class:`VocoderWindow` runs the causal vocoder on the last ``context_frames`` mel frames before the chunk's and the
chunk's. Every layer of the vocoder looks back a bounded number of frames, except the harmonic source's phase, which
sums f0 over the whole stream; the window carries that sum (float64, ``phase0`` of the source), keeps the f0 of the
frames it has already computed instead of recomputing them at its left edge, and draws the NSF noise forward from
the same seeded generator as the official buffer (sample ``i`` gets the official noise of sample ``i``). With
``context_frames`` at least the vocoder's receptive field (:data:`VOCODER_CONTEXT_FRAMES` covers the release's), its
samples equal the official recompute's up to float rounding, at a cost per chunk that does not grow. Past the
official 300 s (where the official code stops) the noise continues from the generator and the phase sum is reduced
modulo one cycle of the sample-rate phase, so that float32 keeps its precision.

Used by the streams with a flow state (:mod:`.token2wav`) and by live conversion's token window (:mod:`.window`).
"""

from __future__ import annotations

import numpy as np
import torch

from .hift import (
    NOISE_COLUMNS,
    NOISE_MAX_SAMPLES,
    CausalConvRNNF0Predictor,
    CausalHiFTGenerator,
    draw_causal_nsf_noise,
)

__all__ = ["VOCODER_CONTEXT_FRAMES", "NoiseWindow", "VocoderWindow"]

#: Mel frames of context before a chunk's first new frame that make the vocoder window's samples equal to the
#: whole-stream call's (the release's receptive field, measured: ``tests/unit/test_cv3_window.py``), with a margin.
VOCODER_CONTEXT_FRAMES = 32


class NoiseWindow:
    """The official causal NSF noise (:func:`~.hift.draw_causal_nsf_noise` under ``seed``), drawn forward as a
    stream needs it and kept from :meth:`drop`'s sample on: ``take(lo, hi)`` is rows ``lo:hi`` of the one long
    draw. Past the official 300 s the draw goes on (the official buffer ends there)."""

    def __init__(self, seed: int):
        self._generator = torch.Generator().manual_seed(int(seed))
        self._noise = draw_causal_nsf_noise(0, self._generator)  # the official draws up to the buffer's first row
        self.base = 0  # sample index of self._noise's first row

    @property
    def held(self) -> int:
        return self._noise.shape[1]

    def take(self, lo: int, hi: int) -> torch.Tensor:
        if lo < self.base:
            raise ValueError(f"noise from sample {lo} was dropped (kept from {self.base})")
        end = self.base + self.held
        if hi > end:
            more = torch.rand(1, hi - end, NOISE_COLUMNS, generator=self._generator)
            self._noise = torch.cat([self._noise, more], dim=1)
        return self._noise[:, lo - self.base: hi - self.base]

    def drop(self, before: int) -> None:
        if before > self.base:
            self._noise = self._noise[:, before - self.base:].clone()
            self.base = before


class VocoderWindow:
    """One stream's causal vocoder on a bounded mel window (module docstring). Call it with each chunk's new mel
    ``[1, 80, n]``; it returns the chunk's new float32 samples: ``final=False`` holds back the audio of the last
    ``held_frames`` (8) frames, as the official ``finalize=False``, and ``final=True`` flushes everything."""

    def __init__(self, hift: CausalHiFTGenerator, *, context_frames: int = VOCODER_CONTEXT_FRAMES,
                 seed: int | None = None):
        if context_frames < 0:
            raise ValueError(f"context_frames must be >= 0, got {context_frames}")
        self.hift, self.context = hift, int(context_frames)
        self.factor = hift.upsample_factor
        self.noise = NoiseWindow(hift.noise.seed if seed is None else seed)
        self.mel: torch.Tensor | None = None  # [1, 80, n]: frames base .. base + n
        self.base = 0
        self.f0 = torch.zeros(1, 0)  # f0 already computed for frames base .. base + len (never recomputed)
        self.phase0 = torch.zeros(1, 1, hift.m_source.harmonics, dtype=torch.float64)  # rad summed before base
        self.samples = 0  # samples returned
        self.finished = False

    @torch.inference_mode()
    def __call__(self, mel: torch.Tensor, *, final: bool) -> np.ndarray:
        if self.finished:
            raise ValueError("VocoderWindow: the stream's final chunk has run")
        hift, look = self.hift, CausalConvRNNF0Predictor.LOOK_AHEAD
        mel = mel.float()
        mel = mel if self.mel is None else torch.cat([self.mel, mel], dim=2)
        f0 = hift.predict_f0(mel, finalize=final)
        known = self.f0.shape[1]
        f0 = torch.cat([self.f0.to(f0.dtype), f0[:, known:]], dim=1)
        lo = self.base * self.factor
        noise = self.noise.take(lo, lo + self.factor * f0.shape[1])
        source = hift.m_source(f0, noise.to(f0.dtype), phase0=self.phase0)
        speech = hift.decode(mel if final else mel[:, :, :-look], source, finalize=final)
        new = speech[0, self.samples - lo:]
        self.samples += new.shape[0]
        if final:
            self.finished, self.mel = True, None
        else:
            self._slide(mel, f0)
        return new.float().cpu().numpy()

    def _slide(self, mel: torch.Tensor, f0: torch.Tensor) -> None:
        """Keep the frames the next chunk's samples need: ``context`` frames before the first unanswered one."""
        start = max(self.base, self.samples // self.factor - self.context)
        drop = start - self.base
        if drop:
            rad = self.hift.m_source.rad(f0[:, :drop])
            self.phase0 = self.phase0 + rad.double().sum(dim=1, keepdim=True)
            if start * self.factor >= NOISE_MAX_SAMPLES:  # beyond the official range: keep float32's precision
                self.phase0 = torch.remainder(self.phase0, 1.0 / self.factor)
        self.mel, self.f0, self.base = mel[:, :, drop:], f0[:, drop:], start
        self.noise.drop(start * self.factor)
