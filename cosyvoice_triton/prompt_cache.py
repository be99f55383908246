"""Prompts by content: what a prompt recording gives (speech tokens, 24 kHz mel, CAM++ embedding, or the
front end's features of it) computed once per distinct recording and reused.

Many requests share a target speaker; a repeated prompt then skips the audio front end, the speech tokenizer
and the speaker encoder. An entry's key (:func:`prompt_key`) is a BLAKE2b digest of everything that changes the
result: the validated mono float32 samples (so the same audio sent as samples or as a wav file is one entry),
their sample rate, what kind of entry it is, and the options of the computation (model identity, mel settings,
VAD / denoising, length limits). Values are read-only numpy arrays by name. :class:`PromptCache` is a
least-recently-used cache bounded by entries and by bytes (``cachetools.LRUCache`` sized by the arrays'
``nbytes``), safe to share between threads; every cache counts its hits, misses and evictions, and
:func:`prompt_cache_totals` sums them over all caches of the process (for metrics)::

    cache = PromptCache(max_entries=256, max_bytes=64 << 20)
    key = prompt_key(wave, 16000, kind="vc_prompt", options={"model": model_id})
    entry = cache.get_or_compute(key, lambda: {"tokens": ..., "mel": ..., "embedding": ...})
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable, Mapping
from pathlib import Path

import cachetools
import numpy as np

__all__ = ["CacheEntry", "PromptCache", "file_identity", "prompt_cache_totals", "prompt_key"]

#: An entry: arrays by name (read-only).
CacheEntry = Mapping[str, np.ndarray]

_totals = {"hits": 0, "misses": 0, "evictions": 0}
_totals_lock = threading.Lock()


def _count(name: str, n: int = 1) -> None:
    with _totals_lock:
        _totals[name] += n


def prompt_cache_totals() -> dict[str, int]:
    """Hits, misses and evictions of every :class:`PromptCache` of this process since it started."""
    with _totals_lock:
        return dict(_totals)


def prompt_key(samples: np.ndarray, sample_rate: int, *, kind: str, options: Mapping[str, object]) -> str:
    """Hex digest of a prompt computation: its audio (samples, dtype, shape), rate, ``kind`` and ``options``
    (anything that changes the result; values are hashed by their ``repr``, so use plain numbers and strings)."""
    arr = np.ascontiguousarray(samples)
    h = hashlib.blake2b(digest_size=32)
    header = [kind, str(arr.dtype), str(arr.shape), str(int(sample_rate))]
    header += [f"{k}={options[k]!r}" for k in sorted(options)]
    h.update("\x1f".join(header).encode("utf-8"))
    h.update(b"\x1e")
    h.update(memoryview(arr).cast("B"))
    return h.hexdigest()


def file_identity(*paths: str | Path) -> str:
    """A cheap identity of model files for cache keys: resolved path, size and modification time of each."""
    parts = []
    for p in paths:
        p = Path(p).resolve()
        st = p.stat()
        parts.append(f"{p}:{st.st_size}:{st.st_mtime_ns}")
    return ";".join(parts)


def _nbytes(entry: CacheEntry) -> int:
    return sum(int(a.nbytes) for a in entry.values()) + 256  # + the key and the dict, roughly


def _frozen(entry: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    out = {}
    for name, value in entry.items():
        a = np.array(value, copy=True, order="C")
        a.setflags(write=False)
        out[name] = a
    return out


class _LRU(cachetools.LRUCache):
    evictions = 0

    def popitem(self):
        item = super().popitem()
        self.evictions += 1
        _count("evictions")
        return item


class PromptCache:
    """A bounded, thread-safe LRU of prompt computations (see the module docstring).

    Args:
        max_entries: most entries kept (>= 1).
        max_bytes: most bytes of arrays kept (>= 1); an entry larger than this is computed but not kept.
    """

    def __init__(self, max_entries: int = 256, max_bytes: int = 64 << 20):
        if int(max_entries) < 1 or int(max_bytes) < 1:
            raise ValueError(f"PromptCache needs max_entries >= 1 and max_bytes >= 1, got {max_entries}, {max_bytes}")
        self.max_entries, self.max_bytes = int(max_entries), int(max_bytes)
        self._lru = _LRU(maxsize=self.max_bytes, getsizeof=_nbytes)
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    @classmethod
    def from_params(cls, entries: int, megabytes: float) -> PromptCache | None:
        """The cache of a served model's tunables (``prompt_cache_entries``, ``prompt_cache_mb``); ``None``
        (no cache) when either is 0."""
        if entries <= 0 or megabytes <= 0:
            return None
        return cls(max_entries=entries, max_bytes=int(megabytes * (1 << 20)))

    def get(self, key: str) -> CacheEntry | None:
        """The entry under ``key`` (and it becomes the most recently used), or ``None``; counts a hit or a miss."""
        with self._lock:
            entry = self._lru.get(key)
            if entry is None:
                self.misses += 1
            else:
                self.hits += 1
        _count("misses" if entry is None else "hits")
        return entry

    def put(self, key: str, entry: Mapping[str, np.ndarray]) -> CacheEntry:
        """Keep a read-only copy of ``entry`` under ``key`` (evicting the least recently used entries to stay
        within both bounds) and return it."""
        frozen = _frozen(entry)
        with self._lock:
            if _nbytes(frozen) <= self.max_bytes:
                self._lru[key] = frozen
                while len(self._lru) > self.max_entries:
                    self._lru.popitem()
        return frozen

    def get_or_compute(self, key: str, compute: Callable[[], Mapping[str, np.ndarray]]) -> CacheEntry:
        """The entry under ``key``, computed by ``compute()`` (outside the lock) on a miss and kept."""
        entry = self.get(key)
        return entry if entry is not None else self.put(key, compute())

    def stats(self) -> dict[str, int]:
        """hits, misses, evictions, entries and bytes held."""
        with self._lock:
            return {"hits": self.hits, "misses": self.misses, "evictions": self._lru.evictions,
                    "entries": len(self._lru), "bytes": int(self._lru.currsize)}

    def clear(self) -> None:
        with self._lock:
            self._lru.clear()

    def __len__(self) -> int:
        with self._lock:
            return len(self._lru)

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._lru
