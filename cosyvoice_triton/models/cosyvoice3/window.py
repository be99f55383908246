"""CosyVoice3's token-to-wav over a sliding window, for streams of any length (live voice conversion).

The official streaming ``token2wav`` (:class:`~.token2wav.Token2Wav3`) runs the flow on every token so far and the
vocoder on every mel frame so far at each chunk: the cost of a chunk grows with the stream, and so does the memory
(the vocoder's NSF noise buffer holds 300 s). A live stream has no end to plan for, so here both run on a bounded
window:

- :class:`VocoderWindow`: the causal vocoder on the last ``context_frames`` mel frames before the chunk's and the
  chunk's. Every layer of the vocoder looks back a bounded number of frames, except the harmonic source's phase,
  which sums f0 over the whole stream; the window carries that sum (float64, ``phase0`` of the source), keeps the
  f0 of the frames it has already computed instead of recomputing them at its left edge, and draws the NSF noise
  forward from the same seeded generator as the official buffer (sample ``i`` gets the official noise of sample
  ``i``). With ``context_frames`` at least the vocoder's receptive field (:data:`VOCODER_CONTEXT_FRAMES` covers the
  release's), its samples equal the official recompute's up to float rounding, at a cost per chunk that does not
  grow. Past the official 300 s (where the official code stops) the noise continues from the generator and the
  phase sum is reduced modulo one cycle of the sample-rate phase, so that float32 keeps its precision.
- :class:`Token2Wav3Window`: the flow on the prompt and a window of source tokens (the caller's: it chooses how
  many tokens before the chunk's first to keep), each frame with the official fixed noise of its place in the whole
  stream. The DiT's attention is chunk-causal (25 tokens) in streaming mode and its convolution causal, so a window
  that still starts at the first source token computes exactly the official frames; once the window slides, the
  frames see only the window's tokens before them (and the prompt), a bounded approximation of the official
  whole-stream attention, as CosyVoice2's live conversion.
"""

from __future__ import annotations

import numpy as np
import torch

from ...errors import CosyVoiceError
from .hift import (
    NOISE_COLUMNS,
    NOISE_MAX_SAMPLES,
    CausalConvRNNF0Predictor,
    CausalHiFTGenerator,
    draw_causal_nsf_noise,
)
from .token2wav import Token2Wav3

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


class Token2Wav3Window:
    """One stream's flow + vocoder over a sliding token window (module docstring).

    :meth:`step` is one chunk: ``tokens`` the window (every source token the flow sees, the 3 look-ahead tokens
    included unless ``final``), ``offset`` where the chunk's new tokens start in it. The window's place in the
    stream follows from what earlier steps produced. The flow and vocoder are ``token2wav``'s, the prompt as its
    methods take it (and checked as they check it); outputs float32 audio at 24 kHz.
    """

    def __init__(self, token2wav: Token2Wav3, prompt_tokens, prompt_feat, embedding, *,
                 vocoder_context_frames: int = VOCODER_CONTEXT_FRAMES, seed: int | None = None):
        self.flow, self.device = token2wav.flow, token2wav.device
        self.prompt_tokens, self.prompt_feat, self.embedding = token2wav._prompt(prompt_tokens, prompt_feat,
                                                                                 embedding)
        self.vocoder = VocoderWindow(token2wav.hift, context_frames=vocoder_context_frames, seed=seed)
        self.ratio, self.lookahead = self.flow.token_mel_ratio, self.flow.pre_lookahead_len
        self.produced = 0  # source tokens whose mel has been produced

    def _noise(self, start: int, frames: int) -> torch.Tensor:
        """The official fixed noise of the prompt's frames and of ``frames`` frames from source token ``start`` on
        (the buffer repeats past its end, 300 s, where the official code stops)."""
        buf = self.flow.decoder.rand_noise
        prompt = self.prompt_tokens.shape[1] * self.ratio
        at = torch.cat([torch.arange(prompt), prompt + start * self.ratio + torch.arange(frames)])
        return buf[:, :, at % buf.shape[-1]]

    @torch.inference_mode()
    def step(self, tokens, offset: int, *, final: bool) -> np.ndarray:
        t = torch.as_tensor(np.asarray(tokens), dtype=torch.int32, device=self.device).reshape(1, -1)
        lookahead = 0 if final else self.lookahead
        if t.shape[1] - lookahead <= offset:
            raise CosyVoiceError(f"a chunk of {t.shape[1]} tokens with {lookahead} look-ahead has no new token "
                                 f"after {offset}")
        if int(t.max()) >= self.flow.dims.vocab_size or int(t.min()) < 0:
            raise CosyVoiceError(f"speech token out of range [0, {self.flow.dims.vocab_size})")
        start = self.produced - int(offset)
        if start < 0:
            raise ValueError(f"offset {offset}: only {self.produced} tokens were produced before this chunk")
        frames = (t.shape[1] - lookahead) * self.ratio
        mel, _ = self.flow.inference(t, self.prompt_tokens, self.prompt_feat, self.embedding, streaming=not final,
                                     finalize=final, noise=self._noise(start, frames).to(self.device))
        self.produced += t.shape[1] - lookahead - int(offset)
        return self.vocoder(mel[:, :, int(offset) * self.ratio:], final=final)

    def close(self) -> None:
        """Nothing to free beyond this object (the torch tensors go with it); for the session's interface."""
