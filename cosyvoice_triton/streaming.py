"""The official CosyVoice2 streaming schedule, shared by the in-process pipeline and the served streams.

Speech tokens arrive one by one (from the LM, or all at once for voice conversion). A chunk runs as soon as its
hop plus the flow's look-ahead tokens have arrived: hops of 25, 50, then 100 tokens (``CosyVoice2Model``'s
``token_hop_len``, doubled by ``stream_scale_factor`` up to ``token_max_hop_len``), the first one longer by the
padding that makes prompt + chunk a multiple of 25. The last chunk, with every token, runs when the tokens end.
The schedule restarts for every request (the official instance keeps doubling across requests; the official
references use a fresh instance). HiFT then keeps :data:`MEL_CACHE` mel frames and as many source samples of
context and crossfades that many samples (Hamming window) with the previous chunk's held-back tail.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np

from .errors import CosyVoiceError

TOKEN_HOP = 25
TOKEN_MAX_HOP = 100
STREAM_SCALE = 2
MEL_CACHE = 8  # mel frames of HiFT context (and 8 * 480 source samples, crossfaded)

__all__ = ["MEL_CACHE", "STREAM_SCALE", "TOKEN_HOP", "TOKEN_MAX_HOP", "StreamChunk", "stream_chunk_ends",
           "stream_chunks"]


@dataclass(frozen=True)
class StreamChunk:
    """One flow call of a stream: ``tokens`` int32 (every token up to the chunk's end plus the look-ahead, or all
    of them when ``final``); its new mel starts at token ``offset`` (``offset * token_mel_ratio`` frames)."""

    tokens: np.ndarray
    offset: int
    final: bool


def stream_chunks(tokens: Iterable[int], n_prompt_tokens: int, *, lookahead: int) -> Iterator[StreamChunk]:
    """The chunks of a stream over ``tokens`` as they arrive (see the module docstring).

    Raises :class:`~cosyvoice_triton.errors.CosyVoiceError` when ``tokens`` is empty.
    """
    pad = -int(n_prompt_tokens) % TOKEN_HOP  # the first chunk only
    hop, offset, got = TOKEN_HOP, 0, []
    for token in tokens:
        got.append(int(token))
        if len(got) - offset < hop + pad + lookahead:
            continue
        end = offset + hop + pad
        yield StreamChunk(np.asarray(got[: end + lookahead], np.int32), offset, False)
        offset, hop, pad = end, min(TOKEN_MAX_HOP, hop * STREAM_SCALE), 0
    if not got:
        raise CosyVoiceError("no speech tokens to synthesise")
    yield StreamChunk(np.asarray(got, np.int32), offset, True)


def stream_chunk_ends(n_tokens: int, n_prompt_tokens: int, *, lookahead: int) -> list[int]:
    """Where the non-final chunks of a stream of ``n_tokens`` end, in tokens (the final chunk is not listed)."""
    if n_tokens <= 0:
        return []
    return [c.offset for c in stream_chunks(range(n_tokens), n_prompt_tokens, lookahead=lookahead)][1:]
