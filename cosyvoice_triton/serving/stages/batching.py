"""Batching helpers shared by the stages: per-request results, padding, equal-length groups, chunks."""

from __future__ import annotations

import traceback
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import numpy as np

from ...errors import CosyVoiceError

__all__ = ["ItemResult", "RequestError", "chunks_by_rows", "drop_traceback", "group_by", "pad_to", "run_per_item"]

T = TypeVar("T")


class RequestError(CosyVoiceError):
    """A request whose tensors cannot be used (wrong shape, dtype, value): the client's mistake, HTTP 400."""


def drop_traceback(exc: BaseException) -> BaseException:
    """``exc`` without the tracebacks of itself and its ``__cause__`` / ``__context__`` chain.

    A stored exception keeps its traceback's frames alive, and with them every array those frames held (a
    refused request's whole input); a frame that also holds the list the exception is stored in makes a
    reference cycle that only a full garbage collection frees, which an idle server may never run. The
    message is all a response needs."""
    stack, seen = [exc], set()
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        e.__traceback__ = None
        stack += [e.__cause__, e.__context__]
    return exc


@dataclass
class ItemResult(Generic[T]):
    """What one request of a batch gets: a value, or the error that only this request fails with.

    ``error`` is a :class:`~cosyvoice_triton.errors.CosyVoiceError` (the client's fault: INVALID_ARG) or any
    other exception (a server fault: INTERNAL); it is stored without its traceback (:func:`drop_traceback`),
    so a failed request's tensors are freed with the request."""

    value: T | None = None
    error: BaseException | None = None

    def __post_init__(self):
        if self.error is not None:
            if not isinstance(self.error, CosyVoiceError) and self.error.__traceback__ is not None:
                # a server fault: keep where it happened, as text, for the log (see triton_io.error_response)
                self.error.traceback_text = "".join(traceback.format_exception(self.error))
            drop_traceback(self.error)

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def invalid_argument(self) -> bool:
        return isinstance(self.error, CosyVoiceError)

    def unwrap(self) -> T:
        if self.error is not None:
            raise self.error
        return self.value  # type: ignore[return-value]


def run_per_item(items: Sequence[Any], fn: Callable[[Any], T]) -> list[ItemResult[T]]:
    """``fn`` on each item; a :class:`CosyVoiceError` fails only its own item (other exceptions propagate)."""
    out: list[ItemResult[T]] = []
    for item in items:
        try:
            out.append(ItemResult(fn(item)))
        except CosyVoiceError as exc:
            out.append(ItemResult(error=exc))
    return out


def pad_to(x: np.ndarray, shape: Sequence[int], value: float = 0) -> np.ndarray:
    """``x`` right-padded with ``value`` to ``shape`` (each dim >= x's)."""
    if tuple(x.shape) == tuple(shape):
        return x
    widths = [(0, int(s) - int(d)) for d, s in zip(x.shape, shape, strict=True)]
    if any(w[1] < 0 for w in widths):
        raise ValueError(f"cannot pad {x.shape} to {tuple(shape)}")
    return np.pad(x, widths, constant_values=value)


def group_by(keys: Iterable[Any]) -> dict[Any, list[int]]:
    """Indices grouped by key, in first-seen order."""
    groups: dict[Any, list[int]] = {}
    for i, k in enumerate(keys):
        groups.setdefault(k, []).append(i)
    return groups


def chunks_by_rows(indices: Sequence[int], rows: Sequence[int], max_rows: int) -> list[list[int]]:
    """Split ``indices`` (in order) into chunks whose summed ``rows[i]`` stays <= ``max_rows``."""
    out: list[list[int]] = []
    cur: list[int] = []
    n = 0
    for i in indices:
        r = int(rows[i])
        if r > max_rows:
            raise RequestError(f"a request of batch {r} exceeds the maximum batch size {max_rows}")
        if cur and n + r > max_rows:
            out.append(cur)
            cur, n = [], 0
        cur.append(i)
        n += r
    if cur:
        out.append(cur)
    return out
