"""Repetition-aware sampling of speech tokens, numerically equal to CosyVoice's ``ras_sampling``.

The official code draws with ``Tensor.multinomial(1, replacement=True)``. Here every draw is one uniform
number ``u`` in [0, 1) from a *draw source*, turned into an index by :func:`pick` (inverse CDF). A parity
oracle that replaces the official ``multinomial`` with :func:`pick` on the same ``u`` sequence therefore gets
the same tokens, and the draws of a request can be fixed (a seed, a list) independently of any other request.

Numerics that matter for equality with the official code:

- the nucleus is taken from ``softmax`` sorted with a *stable* descending sort (ties keep the lower id);
- its running mass is a float32 sum compared with ``float32(top_p)`` (the official loop adds 0-d float32
  tensors and compares them with a Python float, which PyTorch casts to float32);
- a token is kept while the mass *before* it is below ``top_p`` and fewer than ``top_k`` are kept, so the
  first token is always kept and the nucleus may end above ``top_p``;
- the repetition window is ``decoded[-win_size:]`` (Python slicing: ``win_size=0`` means the whole history).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import numpy as np
import torch

from ..config import SamplingConfig
from ..errors import LLMError

Draw = Callable[[], float]
DrawSource = Draw | Iterable[float] | torch.Generator | int | None


def pick(probs: torch.Tensor, u: float) -> int:
    """Index drawn from the unnormalised 1-D weights ``probs`` by the uniform number ``u`` in [0, 1).

    The rule: the first index whose float64 cumulative sum exceeds ``u * total`` (``total`` the float64 sum).
    Indices of zero weight are never returned.
    """
    if not 0.0 <= u < 1.0:
        raise ValueError(f"u must be in [0, 1), got {u!r}")
    weights = probs.detach().reshape(-1).cpu().numpy().astype(np.float64)
    cum = np.cumsum(weights)
    total = cum[-1] if cum.size else 0.0
    if not (np.isfinite(total) and total > 0):
        raise ValueError(f"cannot draw from weights of total {total!r} (size {weights.size})")
    index = int(np.searchsorted(cum, u * total, side="right"))
    if index >= weights.size:  # u * total rounded up to total: the last index of non-zero weight
        index = int(np.flatnonzero(weights > 0)[-1])
    return index


def make_draw(draws: DrawSource = None) -> Draw:
    """A function returning the next uniform draw in [0, 1).

    ``draws`` may be a zero-argument callable, an iterable of floats (a list, an iterator; running out is an
    error), a ``torch.Generator``, an integer seed (a fresh ``torch.Generator`` seeded with it) or ``None``
    (PyTorch's global generator). Generators draw with ``torch.rand(..., dtype=float64)``.
    """
    if draws is None or isinstance(draws, (int, torch.Generator)):
        if isinstance(draws, int) and not isinstance(draws, bool):
            generator: torch.Generator | None = torch.Generator().manual_seed(draws)
        else:
            generator = draws

        def from_generator() -> float:
            return float(torch.rand((), generator=generator, dtype=torch.float64))

        return from_generator
    if callable(draws):
        return draws
    if isinstance(draws, Iterable):
        iterator = iter(draws)

        def from_iterable() -> float:
            try:
                u = float(next(iterator))
            except StopIteration:
                raise LLMError("the sequence of sampling draws ran out") from None
            if not 0.0 <= u < 1.0:
                raise LLMError(f"sampling draw {u!r} is not in [0, 1)")
            return u

        return from_iterable
    raise TypeError(f"draws must be a callable, an iterable of floats, a torch.Generator, a seed or None, "
                    f"got {type(draws).__name__}")


def check_sampling(config: SamplingConfig) -> None:
    if not 0.0 < config.top_p <= 1.0:
        raise LLMError(f"sampling top_p must be in (0, 1], got {config.top_p}")
    if config.top_k < 1:
        raise LLMError(f"sampling top_k must be >= 1, got {config.top_k}")
    if config.win_size < 0 or config.tau_r < 0:
        raise LLMError(f"sampling win_size and tau_r must be >= 0, got {config.win_size}, {config.tau_r}")


def nucleus_size(sorted_probs: torch.Tensor, *, top_p: float, top_k: int) -> int:
    """How many of the descending ``sorted_probs`` the nucleus keeps (at least one, at most ``top_k``)."""
    head = sorted_probs[:top_k].detach().cpu().numpy().astype(np.float32, copy=False)
    mass_before = np.cumsum(head[:-1], dtype=np.float32)  # float32 running sum, in order
    return 1 + int(np.count_nonzero(mass_before < np.float32(top_p)))


def nucleus_sampling(scores: torch.Tensor, draw: Draw, *, top_p: float = 0.8, top_k: int = 25) -> int:
    """Draw a token from the smallest set of most likely ones holding ``top_p`` mass, at most ``top_k``.

    ``scores``: 1-D log-probabilities (or logits) ``[V]``. Consumes one draw.
    """
    probs, order = top_sorted(scores.softmax(dim=0), top_k)
    n = nucleus_size(probs, top_p=top_p, top_k=top_k)
    return int(order[pick(probs[:n], draw())])


def top_sorted(probs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``k`` of ``probs.sort(descending=True, stable=True)`` (values, indices) without sorting all.

    Every entry tied with the k-th largest is a candidate, so ties resolve to the lower index as in the
    full stable sort.
    """
    k = min(k, probs.numel())
    kth = probs.topk(k).values[-1]
    candidates = torch.nonzero(probs >= kth).flatten()  # ascending ids
    values = probs[candidates]
    order = values.sort(descending=True, stable=True).indices[:k]
    return values[order], candidates[order]


def random_sampling(scores: torch.Tensor, draw: Draw) -> int:
    """Draw a token from the whole ``softmax(scores)``. Consumes one draw."""
    return pick(scores.softmax(dim=0), draw())


def ras_sampling(
    scores: torch.Tensor,
    decoded: Sequence[int],
    draw: Draw,
    *,
    top_p: float = 0.8,
    top_k: int = 25,
    win_size: int = 10,
    tau_r: float = 0.1,
) -> int:
    """Repetition-aware sampling: a nucleus draw, re-drawn from the full distribution without that token when
    it occurs at least ``win_size * tau_r`` times in ``decoded[-win_size:]``.

    ``scores``: 1-D log-probabilities ``[V]`` (not modified). Consumes one draw, two on a re-draw.
    """
    token = nucleus_sampling(scores, draw, top_p=top_p, top_k=top_k)
    repeats = sum(1 for t in decoded[-win_size:] if t == token)
    if repeats >= win_size * tau_r:
        scores = scores.clone()
        scores[token] = -float("inf")
        token = random_sampling(scores, draw)
    return token


def sample_token(
    logp: torch.Tensor,
    decoded: Sequence[int],
    draw: Draw,
    config: SamplingConfig,
    *,
    eos_token: int,
    ignore_eos: bool,
) -> int:
    """One step of the official ``sampling_ids``: with ``ignore_eos`` the end-of-speech id ``eos_token``
    alone is masked (the two other stop ids stay drawable), then :func:`ras_sampling`.

    ``logp``: 1-D log-probabilities ``[speech_token_size + 3]`` (not modified).
    """
    if ignore_eos:
        logp = logp.clone()
        logp[eos_token] = -float("inf")
    return ras_sampling(logp, decoded, draw, top_p=config.top_p, top_k=config.top_k,
                        win_size=config.win_size, tau_r=config.tau_r)
