"""Which failed calls a client sends again, and how long it waits between tries (``tenacity``).

Sent again, because the server did not do the work or doing it twice does no harm (inference is a pure function
of its inputs and seed):

* the server could not take the request: gRPC ``UNAVAILABLE`` (also what Triton answers when a queue is full,
  ``max_queue_size``, or a queued request timed out, and while a model is being reloaded), HTTP 503;
* overloaded: gRPC ``RESOURCE_EXHAUSTED``, HTTP 429; a proxy in front could not reach Triton: HTTP 502 / 504;
* timeouts and lost connections: gRPC ``DEADLINE_EXCEEDED``, a refused or reset connection, a socket timeout;
* three server faults that say the server is mending itself (measured with a stage killed under load,
  tests/live/test_hardening_live.py): a stage's Python process died under the request ("Stub process ... is not
  healthy", HTTP 500 / ``INTERNAL``; the supervisor reloads it in seconds); a pipeline whose stage is being
  reloaded ("... has no available versions", HTTP 400 or 404 / ``NOT_FOUND``: Triton unloads the ensemble
  with its member); a BLS stage whose callee is being reloaded ("Failed for execute the inference request. Model
  '...' is not ready.", ``INTERNAL``: Triton does not know that a BLS stage depends on it).

Never sent again: bad input (HTTP 400 / ``INVALID_ARGUMENT``: the next try would fail the same way, whatever the
message says: it may quote the client's text) and any other
server error (a bug would only be hit once more), and a streamed call once a chunk has arrived (not handled here:
the caller already has part of the answer).

The wait before try ``n + 1`` is drawn uniformly from ``[0, min(max_wait, first_wait * 2**(n-1))]`` ("full
jitter": clients that failed together do not come back together), and all tries stop at ``attempts`` or once
``deadline`` seconds have passed since the first.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

import tenacity

log = logging.getLogger(__name__)

__all__ = ["DEFAULT_RETRY", "NO_RETRY", "RETRY_GRPC_STATUSES", "RETRY_HTTP_STATUSES", "RetryPolicy", "is_retryable"]

RETRY_GRPC_STATUSES = frozenset({"StatusCode.UNAVAILABLE", "StatusCode.RESOURCE_EXHAUSTED",
                                 "StatusCode.DEADLINE_EXCEEDED"})
RETRY_HTTP_STATUSES = frozenset({"429", "502", "503", "504"})
#: Statuses the clients give to failures of their own that are worth another try.
RETRY_CLIENT_STATUSES = frozenset({"timeout", "connection"})
#: Server messages of a transient state, each only with the status Triton gives it (see the module docstring): a
#: server fault's (500 / INTERNAL) or an unloaded model's (NOT_FOUND); never a refusal of the client's input.
RETRY_MESSAGES = ("is not healthy", "has no available versions", "Failed for execute the inference request. Model")
_FAULT_STATUSES = frozenset({"500", "StatusCode.INTERNAL", "StatusCode.NOT_FOUND"})
#: HTTP answers an unloaded model 400, the status of bad input, or 404 (both seen from tritonserver 2.51 while a
#: stage's reload took its ensemble down): only Triton's own whole message is retried there (a model's refusal,
#: which may quote the client's text, never is).
_UNLOADED_400 = re.compile(r"Request for unknown model: '[^']*' has no available versions")


def _status(exc: BaseException) -> str | None:
    status = getattr(exc, "status", None)
    status = status() if callable(status) else status
    return None if status is None else str(status)


def is_retryable(exc: BaseException) -> bool:
    """Whether a call that raised ``exc`` may be sent again (see the module docstring)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:  # VCError wraps tritonclient's exception: look through it
        seen.add(id(exc))
        status = _status(exc)
        if status in RETRY_GRPC_STATUSES or status in RETRY_HTTP_STATUSES or status in RETRY_CLIENT_STATUSES:
            return True
        message = exc.message() if callable(getattr(exc, "message", None)) else str(exc)
        if status in _FAULT_STATUSES and any(m in str(message) for m in RETRY_MESSAGES):
            return True
        if status in ("400", "404") and _UNLOADED_400.fullmatch(str(message).strip()):
            return True
        if status is None and isinstance(exc, (ConnectionError, TimeoutError)):
            return True
        if status is None and type(exc).__module__.startswith(("gevent", "aiohttp", "asyncio")) and (
                "Timeout" in type(exc).__name__ or "Connect" in type(exc).__name__
                or "Disconnect" in type(exc).__name__):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how long a client tries a call: at most ``attempts`` tries (1: no retry), waits with full
    jitter capped at ``max_wait`` s, everything within ``deadline`` s of the first try (None: no limit)."""

    attempts: int = 10  # with these waits, enough to ride out a stage reload (~5 s) or a server restart (~30 s)
    first_wait: float = 0.5
    max_wait: float = 8.0
    deadline: float | None = 120.0  # a call that timed out after this is not sent again

    def __post_init__(self):
        if self.attempts < 1 or self.first_wait < 0 or self.max_wait < self.first_wait:
            raise ValueError(f"RetryPolicy: attempts >= 1, 0 <= first_wait <= max_wait, got {self}")
        if self.deadline is not None and self.deadline <= 0:
            raise ValueError(f"RetryPolicy: deadline must be > 0 or None, got {self.deadline}")

    def _kwargs(self, on_retry) -> dict:
        stop = tenacity.stop_after_attempt(self.attempts)
        if self.deadline is not None:
            stop = stop | tenacity.stop_after_delay(self.deadline)

        def before_sleep(state: tenacity.RetryCallState) -> None:
            exc = state.outcome.exception() if state.outcome else None
            log.warning("retrying after %s (try %d of %d, waiting %.2f s)", exc, state.attempt_number,
                        self.attempts, state.next_action.sleep if state.next_action else 0.0)
            if on_retry is not None:
                on_retry(exc)

        return {"stop": stop, "wait": tenacity.wait_random_exponential(multiplier=self.first_wait,
                                                                          max=self.max_wait),
                "retry": tenacity.retry_if_exception(is_retryable), "reraise": True, "before_sleep": before_sleep}

    def retrying(self, on_retry=None) -> tenacity.Retrying:
        """``for attempt in policy.retrying(): with attempt: call()`` (the last failure is raised as it is)."""
        return tenacity.Retrying(**self._kwargs(on_retry))

    def async_retrying(self, on_retry=None) -> tenacity.AsyncRetrying:
        """``async for attempt in policy.async_retrying(): with attempt: await call()``."""
        return tenacity.AsyncRetrying(**self._kwargs(on_retry))


DEFAULT_RETRY = RetryPolicy()
NO_RETRY = RetryPolicy(attempts=1)
