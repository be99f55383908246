"""One in-flight batched LM decode loop: requests join and leave a running :class:`~...models.llm.BatchDecoder`.

:class:`LMEngine` owns the decoder and ONE background thread that steps it. :meth:`LMEngine.submit` queues a
request and returns an :class:`LMJob` at once; the loop admits waiting jobs between steps (at most
``max_active`` rows decode together), samples one token for every active row per step, and hands each token
to its job's queue as soon as it is sampled, so the job's consumer (a token-to-wav worker) runs while the LM
goes on. A job whose consumer cancels (:meth:`LMJob.cancel`, or its ``cancelled()`` callable turning true, e.g. a
closed gRPC stream) leaves the batch before the next step and its cache rows are freed.

Queue policy: at most ``max_waiting`` jobs wait for a row; one more is refused at once (:class:`EngineBusy`);
a job that waits longer than ``wait_timeout_s`` is refused with the same error. Nothing blocks forever: a
consumer's :meth:`LMJob.tokens` raises when the job ends in any way other than end-of-speech.

:attr:`LMEngine.stats` counts what happened (steps, request-steps, admitted / finished / cancelled / refused
jobs, the widest batch); two overlapping jobs decoding together show ``request_steps`` growing faster than
``steps``.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from ...errors import CosyVoiceError, LLMError
from ...models.llm import END, LMRequest, Qwen2LM

log = logging.getLogger(__name__)

__all__ = ["BUSY", "EngineBusy", "EngineStream", "JobCancelled", "LMEngine", "LMJob"]

#: How every :class:`EngineBusy` message starts (a BLS caller that only sees the message maps it to UNAVAILABLE).
BUSY = "TTS busy: "

_CANCELLED = object()


class EngineBusy(RuntimeError):
    """No LM row for this request: too many waiting, or it waited too long (the server answers UNAVAILABLE)."""


class JobCancelled(RuntimeError):
    """The job was cancelled (its client went away) before it finished."""


@dataclass
class LMJob:
    """A request in the engine: read its tokens with :meth:`tokens` (one consumer)."""

    request: LMRequest
    cancelled: Callable[[], bool] = lambda: False
    id: int = 0
    submitted: float = field(default_factory=time.monotonic)
    _queue: queue.Queue = field(default_factory=queue.Queue)
    _cancel: threading.Event = field(default_factory=threading.Event)
    hit_max_len: bool = False
    n_tokens: int = 0
    _row: object = None

    def cancel(self) -> None:
        """Leave the batch (before the next step) and stop delivering tokens."""
        self._cancel.set()

    def is_cancelled(self) -> bool:
        return self._cancel.is_set() or bool(self.cancelled())

    def tokens(self, poll_s: float = 0.05) -> Iterator[int]:
        """The speech tokens as they are sampled; ends at end-of-speech (or ``max_len``). Raises
        :class:`JobCancelled`, :class:`EngineBusy` or the decoder's error when the job ends otherwise."""
        while True:
            try:
                item = self._queue.get(timeout=poll_s)
            except queue.Empty:
                if self.is_cancelled():
                    self.cancel()
                    raise JobCancelled(f"LM job {self.id} cancelled") from None
                continue
            if item is END:
                return
            if item is _CANCELLED:
                raise JobCancelled(f"LM job {self.id} cancelled")
            if isinstance(item, BaseException):
                raise item
            self.n_tokens += 1
            yield item


class EngineStream(Iterator[int]):
    """An :class:`LMJob`'s tokens as an iterator; a stream closed (or dropped) before its end cancels its job, so
    that the row is freed. :attr:`hit_max_len` / :attr:`max_len` as :class:`~...models.llm.LMStream`'s."""

    def __init__(self, job: LMJob):
        self.job = job
        self._tokens = self._run()

    def _run(self) -> Iterator[int]:
        try:
            yield from self.job.tokens()
        finally:
            self.job.cancel()

    def __next__(self) -> int:
        return next(self._tokens)

    def close(self) -> None:
        self._tokens.close()

    @property
    def hit_max_len(self) -> bool:
        return self.job.hit_max_len

    @property
    def max_len(self) -> int | None:
        return getattr(self.job._row, "max_len", None)


class LMEngine:
    """ONE decode loop over ``lm`` in a background thread (see the module docstring).

    Args:
        lm: the loaded :class:`~cosyvoice_triton.models.llm.Qwen2LM`.
        max_active: rows decoding together.
        max_waiting: jobs waiting for a row; more are refused at once.
        wait_timeout_s: longest wait for a row.
    """

    def __init__(self, lm: Qwen2LM, *, max_active: int = 8, max_waiting: int = 16, wait_timeout_s: float = 60.0,
                 name: str = "lm-engine"):
        if max_active < 1 or max_waiting < 0 or not wait_timeout_s > 0:
            raise ValueError(f"need max_active >= 1, max_waiting >= 0, wait_timeout_s > 0; got {max_active}, "
                             f"{max_waiting}, {wait_timeout_s}")
        self.lm = lm
        self.decoder = lm.batch_decoder()
        self.max_active, self.max_waiting, self.wait_timeout_s = int(max_active), int(max_waiting), wait_timeout_s
        self._cond = threading.Condition()
        self._waiting: deque[LMJob] = deque()
        self._active: dict[int, LMJob] = {}
        self._ids = itertools.count(1)
        self._stop = False
        self.stats = {"steps": 0, "request_steps": 0, "max_batch": 0, "admitted": 0, "finished": 0, "cancelled": 0,
                      "refused": 0, "failed": 0}
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    # --------------------------------------------------------------------------------------------- API

    def submit(self, request: LMRequest, *, cancelled: Callable[[], bool] = lambda: False) -> LMJob:
        """Queue ``request`` (its tokens checked now: :class:`~...errors.LLMError`); returns at once."""
        self.lm.check_inputs(request.text_tokens, request.prompt_text_tokens, request.prompt_speech_tokens)
        with self._cond:
            if self._stop:
                raise EngineBusy("the LM engine is shut down")
            free = self.max_active - len(self._active)
            if len(self._waiting) >= self.max_waiting + max(free, 0):
                self.stats["refused"] += 1
                raise EngineBusy(f"{BUSY}too many concurrent TTS requests: {len(self._active)} decoding "
                                 f"(max_active_requests {self.max_active}) and {len(self._waiting)} waiting "
                                 f"(max_waiting_requests {self.max_waiting}); retry later")
            job = LMJob(request, cancelled, next(self._ids))
            self._waiting.append(job)
            self._cond.notify_all()
        return job

    def stream(self, request: LMRequest, *, cancelled: Callable[[], bool] = lambda: False) -> EngineStream:
        """:meth:`submit` as an iterator of the job's tokens (:class:`EngineStream`)."""
        return EngineStream(self.submit(request, cancelled=cancelled))

    def snapshot(self) -> dict[str, int]:
        with self._cond:
            return {**self.stats, "active": len(self._active), "waiting": len(self._waiting)}

    def close(self, timeout: float = 5.0) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(timeout)

    # -------------------------------------------------------------------------------------------- loop

    def _admit(self) -> None:
        """Under the lock: drop cancelled / expired jobs, move waiting jobs into free rows."""
        for job in [j for j in self._active.values() if j.is_cancelled()]:
            self.decoder.remove(job.id)
            del self._active[job.id]
            self.stats["cancelled"] += 1
            job._queue.put(_CANCELLED)
        now = time.monotonic()
        keep: deque[LMJob] = deque()
        for job in self._waiting:
            if job.is_cancelled():
                self.stats["cancelled"] += 1
                job._queue.put(_CANCELLED)
            elif now - job.submitted > self.wait_timeout_s:
                self.stats["refused"] += 1
                job._queue.put(EngineBusy(f"{BUSY}no LM row within {self.wait_timeout_s:g} s ({self.max_active} "
                                          "requests decoding): retry later"))
            elif len(self._active) < self.max_active:
                try:
                    self.decoder.add(job.request, request_id=job.id)
                except CosyVoiceError as exc:
                    self.stats["failed"] += 1
                    job._queue.put(exc)
                    continue
                self._active[job.id] = job
                job._row = self.decoder.row(job.id)
                self.stats["admitted"] += 1
            else:
                keep.append(job)
        self._waiting = keep

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._stop and not self._active and not self._waiting:
                    self._cond.wait()
                if self._stop:
                    for job in [*self._active.values(), *self._waiting]:
                        job._queue.put(_CANCELLED)
                    return
                self._admit()
                if not self._active:
                    if self._waiting:  # rows are full of nothing: only cancelled / waiting jobs; wait a little
                        self._cond.wait(0.05)
                    continue
            try:
                out = self.decoder.step()
            except Exception as exc:  # a decoder failure fails the jobs of this batch, not the server
                log.exception("LM step failed")
                with self._cond:
                    for job in self._active.values():
                        job._queue.put(LLMError(f"LM decoding failed: {type(exc).__name__}: {exc}"))
                        self.stats["failed"] += 1
                    self._active.clear()
                    self.decoder = self.lm.batch_decoder()
                continue
            with self._cond:
                produced = sum(1 for t in out.values() if t != END)
                self.stats["steps"] += 1
                self.stats["request_steps"] += produced
                self.stats["max_batch"] = max(self.stats["max_batch"], produced)
                for rid, token in out.items():
                    job = self._active.get(rid)
                    if job is None:
                        continue
                    if token == END:
                        job.hit_max_len = job._row.hit_max_len
                        del self._active[rid]
                        self.stats["finished"] += 1
                        job._queue.put(END)
                    else:
                        job._queue.put(token)
