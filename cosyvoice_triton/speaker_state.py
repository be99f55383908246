"""Work done once per registered speaker: the parts of a request that only the speaker's prompt decides.

Every request of a registered speaker starts with the same prompt, so two computations repeat exactly:

- the LM's KV cache of sos and the prompt's transcript tokens (:class:`~.models.llm.LMPrefix`). The text
  to speak follows the transcript in the LM input, and the task id and the prompt speech tokens follow the
  text, so that prefix is all the LM can share;
- in streaming, the flow's settled prompt frames (:func:`~.models.incremental.prompt_state`): the chunk-causal
  encoder and estimator state of the prompt's whole chunks, for every Euler step. A stream continues from a
  copy and computes only the frames after them.

:class:`SpeakerState` keeps both in one least-recently-used cache bounded by bytes. Keys are the content of
what was computed from (token ids; the prompt's tokens, mel and embedding), never a name, so a re-registered
speaker cannot meet a stale entry; :meth:`SpeakerState.drop` removes a prompt's entries, and a
:class:`~.speakers.SpeakerStore` calls it when a speaker is deleted or replaced (:meth:`SpeakerState.follow`).
At CosyVoice2-0.5B dims the flow state is about 4.6 MB per settled mel frame (a 3 s prompt settles 100 frames:
about 460 MB); the LM prefix about 12 KB per position.
"""

from __future__ import annotations

import hashlib
import threading
from typing import TYPE_CHECKING, Any

import cachetools
import numpy as np

if TYPE_CHECKING:
    from .models.incremental import FlowStreamState
    from .models.llm import LMPrefix
    from .speakers import SpeakerPrompt, SpeakerStore

__all__ = ["DEFAULT_SPEAKER_STATE_BYTES", "SpeakerState"]

#: Default bound of a :class:`SpeakerState` (1 GiB: two 3 s prompts' flow state at full dims).
DEFAULT_SPEAKER_STATE_BYTES = 1 << 30

_NONE = object()  # a computation that gave nothing to keep (a prompt shorter than one chunk)


def _digest(kind: str, *arrays: np.ndarray) -> str:
    h = hashlib.blake2b(kind.encode(), digest_size=24)
    for a in arrays:
        a = np.ascontiguousarray(a)
        h.update(f"\x1f{a.dtype}{a.shape}".encode())
        h.update(memoryview(a).cast("B"))
    return h.hexdigest()


def _lm_key(prompt_text_tokens: Any) -> str:
    return _digest("lm", np.asarray(prompt_text_tokens, np.int64).reshape(-1))


def _flow_key(prompt: SpeakerPrompt) -> str:
    return _digest("flow", prompt.prompt_tokens, prompt.prompt_mel, prompt.embedding)


class SpeakerState:
    """A bounded, thread-safe cache of per-speaker LM prefixes and flow prompt states (module docstring).

    ``max_bytes``: most bytes held (an entry larger than this is computed but not kept).
    """

    def __init__(self, max_bytes: int = DEFAULT_SPEAKER_STATE_BYTES):
        if int(max_bytes) < 1:
            raise ValueError(f"SpeakerState needs max_bytes >= 1, got {max_bytes}")
        self.max_bytes = int(max_bytes)
        self._lru = cachetools.LRUCache(maxsize=self.max_bytes, getsizeof=lambda item: item[1])
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def _get_or_compute(self, key: str, compute, nbytes) -> Any:
        with self._lock:
            item = self._lru.get(key)
            if item is not None:
                self.hits += 1
                return item[0]
            self.misses += 1
        value = compute()  # outside the lock: seconds at full dims
        size = 64 if value is None else int(nbytes(value)) + 64
        if size <= self.max_bytes:
            with self._lock:
                self._lru[key] = (_NONE if value is None else value, size)
        return value

    def lm_prefix(self, lm, prompt_text_tokens: Any) -> LMPrefix:
        """The LM's shared prefix for these prompt text tokens (:meth:`~.models.llm.Qwen2LM.prefix`)."""
        return self._get_or_compute(_lm_key(prompt_text_tokens), lambda: lm.prefix(prompt_text_tokens),
                                    lambda p: p.nbytes)

    def flow_state(self, flow, prompt: SpeakerPrompt, tensors, *, max_cache_bytes: int) -> FlowStreamState | None:
        """A fresh copy of the flow's prompt state (:func:`~.models.incremental.prompt_state`) for ``prompt``;
        ``tensors``: its ``(prompt_token [1, Tp], prompt_feat [1, Tf, 80], embedding [1, 192])``. ``None``
        when the prompt settles no chunk."""
        from .models.incremental import prompt_state

        state = self._get_or_compute(
            _flow_key(prompt), lambda: prompt_state(flow, *tensors, max_cache_bytes=max_cache_bytes),
            lambda s: s.nbytes())
        return None if state is None or state is _NONE else state.copy()

    def drop(self, prompt: SpeakerPrompt) -> None:
        """Forget what was computed from ``prompt`` (its flow state and the prefix of its transcript)."""
        with self._lock:
            self._lru.pop(_flow_key(prompt), None)
            self._lru.pop(_lm_key(prompt.prompt_text_tokens), None)

    def follow(self, store: SpeakerStore) -> None:
        """Drop a speaker's entries when ``store`` deletes or replaces it."""
        store.on_forget(self.drop)

    def stats(self) -> dict[str, int]:
        """hits, misses, entries and bytes held."""
        with self._lock:
            return {"hits": self.hits, "misses": self.misses, "entries": len(self._lru),
                    "bytes": int(self._lru.currsize)}

    def clear(self) -> None:
        with self._lock:
            self._lru.clear()
