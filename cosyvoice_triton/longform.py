"""Long sources: voice conversion of sources longer than the speech tokenizer's 30 s, up to
:data:`MAX_SECONDS` (10 minutes).

The tokenizer (a Whisper encoder) takes at most 30 s, and the flow's attention grows with the square of the
length, so a long source is cut into pieces of at most 30 s, each converted with the same prompt, and the
converted pieces are stitched back together:

1. :func:`plan_pieces` cuts the 16 kHz source at low-energy points (the frame RMS of ``librosa.feature.rms``,
   one frame per 25 Hz speech token, smoothed over :data:`SMOOTH_TOKENS`): each cut is the quietest point between
   half and all of the longest core a piece may have. Cuts fall on token boundaries (640 samples at 16 kHz), so
   piece ``i``'s converted audio starts exactly at ``1.5 x`` its source start (960 output samples per token).
   Every piece reaches :data:`OVERLAP_TOKENS` tokens past its cuts on both sides (the edges of a conversion are
   its least reliable part: HiFT's convolutions and the flow's attention see no context there).
2. The pieces are converted as one batch (tokenizer, flow in batches of ``batch_size``; HiFT one piece per call,
   because it is not padding-invariant).
3. :func:`stitch` places each piece at its offset and crossfades the overlaps (:func:`crossfade`: raised-cosine
   fades, power-normalised for the correlation of the two renderings), so the edges of each piece carry no weight
   and the level does not dip at a seam. The result has exactly the length the unsplit
   conversion would have: ``ceil(frames / 4)`` tokens of the whole source, 960 samples each, adjusted by the
   prompt's mel-token offset as in the unsplit path.

Sources of at most :data:`SPLIT_ABOVE_SECONDS` (30 s) are never split: they convert exactly as before.

:func:`convert_in_pieces` runs the three steps around any batched converter: ``CosyVoice2.convert_long`` in
process, :func:`convert_served` against the served ``cosyvoice_vc`` (each piece one request, all in flight at once,
so Triton's dynamic batcher runs them through the flow and HiFT together; the repeated prompt is a hit of the
``preprocess`` prompt cache after the first piece), and ``serving.stages.local.LocalPipeline`` (the ensemble in
process).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import librosa
import numpy as np

from .errors import AudioError
from .frontend import audio

__all__ = ["MAX_SECONDS", "OVERLAP_TOKENS", "SAMPLES_PER_TOKEN", "SPLIT_ABOVE_SECONDS", "Piece", "convert_in_pieces",
           "convert_served", "crossfade", "needs_split", "plan_pieces", "stitch", "token_energy"]

#: Longest source converted (in process and served): 10 minutes.
MAX_SECONDS = 600.0
#: A source longer than this is split (the tokenizer's limit); shorter ones take the one-piece path unchanged.
SPLIT_ABOVE_SECONDS = 30.0
#: 16 kHz source samples per 25 Hz speech token.
SAMPLES_PER_TOKEN = 640
#: Tokens each piece reaches past its cut on each side (0.32 s): the crossfade is twice this (0.64 s).
OVERLAP_TOKENS = 8
#: Frames (tokens) of the RMS moving average that picks the cut: 0.2 s, so a cut lands in a pause, not a
#: single quiet frame inside a word.
SMOOTH_TOKENS = 5
_TOKENIZER_SR = 16000


@dataclass(frozen=True)
class Piece:
    """One piece of a long source, in 16 kHz samples: ``[start, end)`` is what is converted (core plus
    overlaps), ``[cut_before, cut_after)`` its core between two cuts. ``start`` and the cuts are multiples of
    :data:`SAMPLES_PER_TOKEN`."""

    start: int
    end: int
    cut_before: int
    cut_after: int

    @property
    def output_offset(self) -> int:
        """Where the piece's converted audio starts in the stitched 24 kHz output."""
        return self.start // SAMPLES_PER_TOKEN * 960


def needs_split(n_samples: int, sample_rate: int = _TOKENIZER_SR) -> bool:
    """True for a source longer than :data:`SPLIT_ABOVE_SECONDS`."""
    return n_samples > SPLIT_ABOVE_SECONDS * sample_rate


def token_energy(wave16: np.ndarray) -> np.ndarray:
    """RMS of the 16 kHz source around each token boundary (``librosa.feature.rms``, hop = one token),
    smoothed over :data:`SMOOTH_TOKENS` tokens."""
    rms = librosa.feature.rms(y=np.asarray(wave16, np.float32), frame_length=2 * SAMPLES_PER_TOKEN,
                              hop_length=SAMPLES_PER_TOKEN, center=True)[0]
    kernel = np.ones(SMOOTH_TOKENS) / SMOOTH_TOKENS
    return np.convolve(rms, kernel, mode="same")


def plan_pieces(wave16: np.ndarray, *, max_piece_seconds: float = SPLIT_ABOVE_SECONDS,
                overlap_tokens: int = OVERLAP_TOKENS) -> list[Piece]:
    """Cut a 16 kHz source into pieces of at most ``max_piece_seconds`` (overlaps included) at low-energy
    points; a source that fits gives one piece (the whole source)."""
    n = len(wave16)
    max_piece = int(max_piece_seconds * _TOKENIZER_SR) // SAMPLES_PER_TOKEN  # tokens
    max_core = max_piece - 2 * overlap_tokens
    if max_core < 2 * SMOOTH_TOKENS:
        raise ValueError(f"max_piece_seconds={max_piece_seconds} leaves no room beside 2 x {overlap_tokens} "
                         "overlap tokens")
    total = -(-n // SAMPLES_PER_TOKEN)  # tokens, the last one partial
    if total <= max_piece:
        return [Piece(0, n, 0, n)]
    energy = token_energy(wave16)
    cuts = [0]
    while total - cuts[-1] > max_core + overlap_tokens:  # the last piece has overlap on its left side only
        lo = cuts[-1] + max_core // 2
        hi = min(cuts[-1] + max_core, total - overlap_tokens - 1)
        window = energy[lo : hi + 1]
        cuts.append(lo + int(np.flatnonzero(window == window.min())[-1]))  # the latest quietest point
    pieces = []
    for i, cut in enumerate(cuts):
        after = cuts[i + 1] if i + 1 < len(cuts) else None
        start = max(cut - overlap_tokens, 0) * SAMPLES_PER_TOKEN
        end = n if after is None else min((after + overlap_tokens) * SAMPLES_PER_TOKEN, n)
        pieces.append(Piece(start, end, cut * SAMPLES_PER_TOKEN,
                            n if after is None else after * SAMPLES_PER_TOKEN))
    return pieces


def crossfade(tail: np.ndarray, head: np.ndarray) -> np.ndarray:
    """Crossfade the end of one piece (``tail``) into the start of the next (``head``, same length) with gains
    that keep the power constant for their correlation: a raised-cosine fade ``w`` normalised by
    ``sqrt(w**2 + (1-w)**2 + 2 rho w (1-w))``, where ``rho`` (clipped to [0, 1]) is the normalised correlation of
    the two. Identical content (rho = 1) gets complementary gains summing to 1 and is reproduced exactly;
    unrelated renderings (rho = 0, two conversions whose phases differ) get equal-power gains, so the level does
    not dip in the middle."""
    n = len(tail)
    w = np.sin(0.5 * np.pi * (np.arange(n) + 0.5) / n) ** 2
    norm = float(np.linalg.norm(tail) * np.linalg.norm(head))
    rho = 1.0 if norm == 0.0 else float(np.clip(np.dot(tail, head) / norm, 0.0, 1.0))
    gain = 1.0 / np.sqrt(w**2 + (1 - w) ** 2 + 2 * rho * w * (1 - w))
    return tail * (1 - w) * gain + head * w * gain


def stitch(outputs: Sequence[np.ndarray], pieces: Sequence[Piece]) -> np.ndarray:
    """The converted pieces (24 kHz float32, in order) as one waveform: each at its
    :attr:`Piece.output_offset`, overlaps crossfaded (:func:`crossfade`)."""
    if len(outputs) != len(pieces) or not pieces:
        raise ValueError(f"stitch: {len(outputs)} outputs for {len(pieces)} pieces")
    if len(pieces) == 1:
        return np.asarray(outputs[0], np.float32)
    total = pieces[-1].output_offset + len(outputs[-1])
    out = np.zeros(total, np.float64)
    end = 0  # where the audio written so far ends
    for piece, y in zip(pieces, outputs, strict=True):
        y = np.asarray(y, np.float64)
        off = piece.output_offset
        overlap = min(end - off, len(y))
        if overlap < 0:
            raise ValueError(f"stitch: gap of {-overlap} samples before the piece at {off}: pieces must overlap")
        if overlap:
            out[off : off + overlap] = crossfade(out[off : off + overlap], y[:overlap])
        out[off + overlap : off + len(y)] = y[overlap:]
        end = max(end, off + len(y))
    return out[:end].astype(np.float32)


#: Converts 16 kHz source pieces (one prompt, fixed by the caller) into 24 kHz waveforms, in order.
PieceConverter = Callable[[list[np.ndarray]], Sequence[np.ndarray]]


def convert_in_pieces(source16: np.ndarray, convert: PieceConverter) -> np.ndarray:
    """Plan the pieces of a 16 kHz source (at most :data:`MAX_SECONDS`), convert them with one ``convert`` call
    and stitch the results."""
    if len(source16) > MAX_SECONDS * _TOKENIZER_SR:
        raise AudioError(f"source: {len(source16) / _TOKENIZER_SR:.1f} s is too long; at most {MAX_SECONDS:g} s "
                         "is accepted")
    pieces = plan_pieces(source16)
    outputs = list(convert([source16[p.start : p.end] for p in pieces]))
    if len(outputs) != len(pieces):
        raise RuntimeError(f"the converter answered {len(outputs)} waveforms for {len(pieces)} pieces")
    return stitch(outputs, pieces)


def convert_served(client, source, prompt, *, source_sr: int | None = None, prompt_sr: int | None = None,
                   seed: int | None = None) -> np.ndarray:
    """Voice conversion of a source of up to :data:`MAX_SECONDS` through the served ``cosyvoice_vc`` with a
    :class:`~cosyvoice_triton.clients.client.CosyVoiceClient` (``source``/``prompt``: paths, encoded bytes, or samples
    with ``*_sr``): a source of at most 30 s is one ordinary request; a longer one is cut here and its pieces
    sent at once (:meth:`CosyVoiceClient.convert_many`), then stitched. The server must answer the model's 24 kHz
    waveform without per-request loudness normalisation (``postprocess``'s defaults), or the pieces would not
    join. Returns float32 samples at 24 kHz."""
    src16 = audio.load_audio(source, target_sr=_TOKENIZER_SR, sample_rate=source_sr, name="source",
                             max_seconds=MAX_SECONDS)
    if not needs_split(len(src16)):
        result = client.convert(source, prompt, source_sr=source_sr, prompt_sr=prompt_sr, seed=seed)
        return np.asarray(result.waveform, np.float32)

    def convert(pieces: list[np.ndarray]) -> list[np.ndarray]:
        jobs = [{"source": p, "prompt": prompt, "source_sr": _TOKENIZER_SR, "prompt_sr": prompt_sr} for p in pieces]
        waves = []
        for r in client.convert_many(jobs, seed=seed):
            if isinstance(r, Exception):
                raise r
            if r.sample_rate != 24000:
                raise RuntimeError(f"the server answers {r.sample_rate} Hz: long sources need the model's 24 kHz "
                                   "(postprocess output_sample_rate 0)")
            waves.append(np.asarray(r.waveform, np.float32))
        return waves

    return convert_in_pieces(src16, convert)
