"""The CosyVoice2 streaming schedule, shared by the in-process pipeline and the served streams, and CosyVoice3's
(the same hops; its vocoder keeps no crossfade: :mod:`~cosyvoice_triton.models.cosyvoice3.token2wav`).

Speech tokens arrive one by one (from the LM, or all at once for voice conversion). A chunk runs as soon as its
hop plus the flow's look-ahead tokens have arrived. By default the hops are the official ``CosyVoice2Model``'s:
25, 50, then 100 tokens (``token_hop_len``, doubled by ``stream_scale_factor`` up to ``token_max_hop_len``), the
first one longer by the padding that makes prompt + chunk a multiple of 25. The last chunk, with every token, runs
when the tokens end.

:class:`StreamSchedule` makes the hops tunable: the first hop, the growth factor and the largest hop (the
official Triton runtime, for one, starts at 15 tokens and doubles from 25). Every chunk must end on a chunk
boundary of the flow's chunk-causal attention (``static_chunk_size``, 25 tokens, counted from the start of the
prompt): the frames of a chunk then see exactly the keys they see when the whole utterance is computed, so no
emitted frame would change with later tokens. The first hop is therefore padded up to the next boundary, and
every later hop (``first_hop * growth**k``, at most ``max_hop``) must be a multiple of the chunk size; a schedule
that is not is refused (:class:`~cosyvoice_triton.errors.ConfigError`).
:class:`RuntimeSchedule` is the official CosyVoice3 Triton runtime's (``runtime/triton_trtllm``,
``model_repo_cosyvoice3/cosyvoice3``, its default ``dynamic_chunk_strategy`` "exponential"): 15 tokens, then 25,
50, 100, ... doubling without bound, and no padding, so its chunk ends do not fall on the attention chunk's
boundaries (a chunk's last frames are computed without the rest of their block, as the official runtime does).

The schedule restarts for every request (the official instance keeps doubling across requests; the official
references use a fresh instance). HiFT then keeps :data:`MEL_CACHE` mel frames and as many source samples of
context and crossfades that many samples (Hamming window) with the previous chunk's held-back tail.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np

from .errors import ConfigError, CosyVoiceError

TOKEN_HOP = 25
TOKEN_MAX_HOP = 100
STREAM_SCALE = 2
MEL_CACHE = 8  # mel frames of HiFT context (and 8 * 480 source samples, crossfaded)

__all__ = ["MEL_CACHE", "SCHEDULES", "STREAM_SCALE", "TOKEN_HOP", "TOKEN_MAX_HOP", "RuntimeSchedule", "StreamChunk",
           "StreamSchedule", "stream_chunk_ends", "stream_chunks"]


@dataclass(frozen=True)
class StreamSchedule:
    """The hops of a stream, in speech tokens: ``first_hop`` (padded so that prompt + chunk ends on a multiple of
    ``chunk``), then ``first_hop * growth**k`` up to ``max_hop``. ``chunk``: the flow encoder's
    ``static_chunk_size``. Raises :class:`~cosyvoice_triton.errors.ConfigError` for a schedule whose chunks would
    not end on chunk boundaries (module docstring)."""

    first_hop: int = TOKEN_HOP
    growth: int = STREAM_SCALE
    max_hop: int = TOKEN_MAX_HOP
    chunk: int = TOKEN_HOP

    def __post_init__(self):
        names = {"first_hop": "stream_first_hop", "growth": "stream_hop_growth", "max_hop": "stream_max_hop"}
        for field, name in (*names.items(), ("chunk", "static_chunk_size")):
            value = getattr(self, field)
            if isinstance(value, bool) or int(value) != value or value < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")
        if self.max_hop < self.first_hop:
            raise ConfigError(f"stream_max_hop ({self.max_hop}) must be >= stream_first_hop ({self.first_hop})")
        bad = [h for h in self.later_hops() if h % self.chunk]
        if bad:
            raise ConfigError(
                f"stream schedule first_hop={self.first_hop}, growth={self.growth}, max_hop={self.max_hop}: the hops "
                f"after the first ({', '.join(map(str, self.later_hops()))}) must be multiples of the flow's "
                f"{self.chunk}-token attention chunk (so that every chunk ends on a chunk boundary), {bad[0]} is not; "
                f"e.g. first_hop 5 or 10 with growth 5, or first_hop {self.chunk} with growth 2")

    def later_hops(self) -> list[int]:
        """The distinct hops after the first, in order (the last one repeats)."""
        out, hop = [], self.first_hop
        while True:
            nxt = min(self.max_hop, hop * self.growth)
            if out and nxt == out[-1]:
                return out
            out.append(nxt)
            if nxt == hop:
                return out
            hop = nxt

    def first_chunk(self, n_prompt_tokens: int) -> int:
        """Tokens of the first (non-final) chunk after a prompt of ``n_prompt_tokens``: the hop plus its pad."""
        return self.first_hop + (-(int(n_prompt_tokens) + self.first_hop) % self.chunk)

    def hops(self, n_prompt_tokens: int) -> Iterator[int]:
        """The tokens of each non-final chunk in turn (endless)."""
        yield self.first_chunk(n_prompt_tokens)
        nominal = self.first_hop
        while True:
            nominal = min(self.max_hop, nominal * self.growth)
            yield nominal


@dataclass(frozen=True)
class RuntimeSchedule:
    """The official CosyVoice3 Triton runtime's hops (module docstring): ``first_hop``, then ``base * growth**k``
    for k = 0, 1, ...; no padding, no largest hop. ``chunk``: the flow's attention chunk it was written for."""

    first_hop: int = 15
    base: int = TOKEN_HOP
    growth: int = STREAM_SCALE
    chunk: int = TOKEN_HOP

    def __post_init__(self):
        for field in ("first_hop", "base", "growth", "chunk"):
            value = getattr(self, field)
            if isinstance(value, bool) or int(value) != value or value < 1:
                raise ConfigError(f"runtime schedule {field} must be an integer >= 1, got {value!r}")

    def hops(self, n_prompt_tokens: int) -> Iterator[int]:
        """The tokens of each non-final chunk in turn (endless): ``first_hop`` whatever the prompt, then the rest."""
        yield self.first_hop
        hop = self.base
        while True:
            yield hop
            hop *= self.growth


DEFAULT_SCHEDULE = StreamSchedule()
#: the streaming schedules by name, as the served models' ``stream_schedule`` parameter gives them
SCHEDULES = {"official": DEFAULT_SCHEDULE, "runtime": RuntimeSchedule()}


@dataclass(frozen=True)
class StreamChunk:
    """One flow call of a stream: ``tokens`` int32 (every token up to the chunk's end plus the look-ahead, or all
    of them when ``final``); its new mel starts at token ``offset`` (``offset * token_mel_ratio`` frames)."""

    tokens: np.ndarray
    offset: int
    final: bool


def stream_chunks(tokens: Iterable[int], n_prompt_tokens: int, *, lookahead: int,
                  schedule: StreamSchedule | RuntimeSchedule | None = None) -> Iterator[StreamChunk]:
    """The chunks of a stream over ``tokens`` as they arrive (see the module docstring); ``schedule``: the hops
    (``None``: the official ones).

    Raises :class:`~cosyvoice_triton.errors.CosyVoiceError` when ``tokens`` is empty.
    """
    hops = (schedule or DEFAULT_SCHEDULE).hops(n_prompt_tokens)
    hop, offset, got = next(hops), 0, []
    for token in tokens:
        got.append(int(token))
        if len(got) - offset < hop + lookahead:
            continue
        end = offset + hop
        yield StreamChunk(np.asarray(got[: end + lookahead], np.int32), offset, False)
        offset, hop = end, next(hops)
    if not got:
        raise CosyVoiceError("no speech tokens to synthesise")
    yield StreamChunk(np.asarray(got, np.int32), offset, True)


def stream_chunk_ends(n_tokens: int, n_prompt_tokens: int, *, lookahead: int,
                      schedule: StreamSchedule | RuntimeSchedule | None = None) -> list[int]:
    """Where the non-final chunks of a stream of ``n_tokens`` end, in tokens (the final chunk is not listed)."""
    if n_tokens <= 0:
        return []
    return [c.offset for c in stream_chunks(range(n_tokens), n_prompt_tokens, lookahead=lookahead,
                                            schedule=schedule)][1:]
