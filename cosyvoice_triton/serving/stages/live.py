"""Sessions of a live model: a decoupled Python model fed one stream per sequence (Triton's sequence batcher:
correlation id, START / END flags), each request one piece of the input as it arrives.

:class:`LiveSessions` keeps the sessions by correlation id. A START request opens one (refused at once with
UNAVAILABLE beyond ``max_sessions``; INVALID_ARG when the id is already live), and each session has one worker
thread that runs ``handler(ctx)`` over the pieces in order (:class:`LiveContext`: :meth:`~LiveContext.pieces`,
:meth:`~LiveContext.send`), so ``execute()`` returns at once and sessions run side by side. The responses go on
the *current* sender: ``advance="pull"`` (voice conversion) makes a piece's sender current while the handler
works on it and closes it (final flag) when the handler asks for the next piece; ``advance="arrival"`` (text to
speech) makes the newest piece's sender current as soon as it arrives and closes the one before. The END piece's
sender (or the last one) is closed when the handler returns.

State is bounded: at most ``max_queued`` pieces wait per session (a faster sender's next piece is refused with
UNAVAILABLE and may be sent again: back-pressure by refusal, never unbounded memory), and a session is freed when
it ends (END handled), fails, is cancelled (the client went away: its current sender says so) or stays idle (no
piece) for ``idle_timeout_s``; ``on_idle`` says what idleness means for the handler (``"close"``: the session is
dropped, ``"end"``: its pieces end as with END). A piece for an id with no live session is refused naming why
(never started, ended, idle, failed: the last ``remember`` outcomes are kept), except the END of a session that the
model finished before it (a live LM that stopped on its own): that END gets an empty final response, as it would
have had. ``on_change(active)`` is told the number of live sessions after each change (a gauge).

Over a gRPC stream Triton 2.51 passes an error's message but not its code, so every error sent here starts with
the gRPC code's name (``INVALID_ARGUMENT: ...``, ``UNAVAILABLE: ...``: :func:`error_response`).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import numpy as np

from ...errors import CosyVoiceError
from .triton_io import triton_error
from .vc_stream import StreamCancelled

log = logging.getLogger(__name__)

__all__ = ["LiveContext", "LiveSessions", "SessionGauge", "error_response", "exception_response"]

_START, _END = 1, 2  # TRITONSERVER_REQUEST_FLAG_SEQUENCE_START / _END
#: The outcome of a session that the model ended before its END piece (a live LM that stopped on its own): the
#: client's END, whenever it comes, then gets an empty final response, not an error; other late pieces are refused.
_FINISHED = "finished before its END (the model ended it)"
#: Over a gRPC stream Triton 2.51 passes an error's message but not its code: each message starts with the code
_GRPC_NAMES = {"INVALID_ARG": "INVALID_ARGUMENT", "UNAVAILABLE": "UNAVAILABLE", "CANCELLED": "CANCELLED",
               "INTERNAL": "INTERNAL"}


def error_response(pb, code: str, message: str):
    """An error response whose message starts with the gRPC code's name (``UNAVAILABLE: ...``); ``code``: the name
    of a ``pb.TritonError`` code."""
    error = triton_error(pb, f"{_GRPC_NAMES[code]}: {message}", getattr(pb.TritonError, code))
    return pb.InferenceResponse(error=error)


def exception_response(pb, exc: BaseException):
    """:func:`error_response` of an exception: INVALID_ARGUMENT for the client's errors, INTERNAL for ours."""
    if isinstance(exc, StreamCancelled):
        return error_response(pb, "CANCELLED", str(exc))
    if isinstance(exc, CosyVoiceError) or getattr(exc, "invalid_argument", False):
        return error_response(pb, "INVALID_ARG", str(exc))
    log.error("live session failed: %s: %s", type(exc).__name__, exc)
    return error_response(pb, "INTERNAL", f"internal error: {type(exc).__name__}: {exc}")


class _Refused(Exception):
    """A piece refused before it reached a session: (message, code name of pb.TritonError)."""

    def __init__(self, message: str, code: str):
        super().__init__(message)
        self.code = code


class _Piece:
    __slots__ = ("end", "request", "sender", "tensors")

    def __init__(self, request, sender, tensors, end):
        self.request, self.sender, self.tensors, self.end = request, sender, tensors, end


class LiveContext:
    """What a session's handler sees: the first request's tensors, the pieces in order, the current sender."""

    def __init__(self, owner: LiveSessions, key, first: Mapping[str, np.ndarray | None], parameters: Mapping):
        self.owner, self.key, self.first, self.parameters = owner, key, first, parameters
        self.cond = threading.Condition()
        self.queue: collections.deque[_Piece] = collections.deque()
        self.sender = None  # the current sender
        self.open_senders: list = []  # senders not yet closed (the current one last)
        self.received = 0  # pieces received
        self.ended_by = ""  # "end" | "idle" | "cancelled" | "closed" | "finished" once the pieces stop
        self.last_activity = time.monotonic()
        self.busy = False
        self.worker: threading.Thread | None = None

    # ------------------------------------------------------------------------------------------ handler side
    def pieces(self) -> Iterator[tuple[Mapping[str, np.ndarray | None], bool]]:
        """``(tensors, end)`` of each piece in order (the first request is the first piece); stops after the END
        piece, or when the session goes idle (``on_idle="end"``), is cancelled or closed (:attr:`ended_by`)."""
        owner = self.owner
        while True:
            with self.cond:
                if owner.advance == "pull":
                    self._close_senders(keep_current=False)
                self.busy = False
                self.last_activity = time.monotonic()
                while not self.queue and not self.ended_by:
                    self.cond.wait(owner.sweep_s)
                if not self.queue:
                    return
                piece = self.queue.popleft()
                self.busy = True
                if owner.advance == "pull":
                    self.sender = piece.sender
                    self.open_senders.append(piece.sender)
            if self.cancelled():
                self.ended_by = "cancelled"
                raise StreamCancelled("the client cancelled the stream")
            yield piece.tensors, piece.end
            if piece.end:
                with self.cond:
                    self.ended_by = self.ended_by or "end"
                return

    def send(self, tensors: Mapping[str, np.ndarray], *, received_as: str | None = None) -> None:
        """One response on the current sender; ``received_as``: also an INT32 [1, 1] output of that name, the
        pieces received so far (read with the sender, so the count names the piece whose sender carries it)."""
        pb = self.owner.pb
        with self.cond:
            sender = self.sender
            if sender is None:
                return
            if received_as is not None:
                tensors = {**tensors, received_as: np.array([[self.received]], np.int32)}
            sender.send(pb.InferenceResponse(output_tensors=[pb.Tensor(k, np.ascontiguousarray(v))
                                                             for k, v in tensors.items()]))

    def reject(self, exc: BaseException) -> None:
        """Answer the current piece with ``exc`` (INVALID_ARGUMENT for a :class:`CosyVoiceError`) and close its
        sender; the session goes on."""
        pb = self.owner.pb
        with self.cond:
            sender = self.sender
            if sender is None:
                return
            sender.send(exception_response(pb, exc), flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            if sender in self.open_senders:
                self.open_senders.remove(sender)
            self.sender = None

    def cancelled(self) -> bool:
        """The client went away: the current sender (or any open one) is cancelled. Asked under the lock: a sender
        closed by the execute thread (arrival mode closes the previous piece's) must never be asked, since Triton
        frees its response factory with the final flag and asking it then reads freed memory."""
        with self.cond:
            return self._any_cancelled()

    def _any_cancelled(self) -> bool:
        """Under the lock: any open sender is cancelled."""
        for s in self.open_senders:
            try:
                if s.is_cancelled():
                    return True
            except Exception:  # a stub without is_cancelled on senders
                return False
        return False

    # ------------------------------------------------------------------------------------------ owner side
    def _close_senders(self, *, keep_current: bool) -> None:
        """Send the final flag on every open sender (but the current one when ``keep_current``); under the lock."""
        pb = self.owner.pb
        keep = self.sender if keep_current else None
        for s in list(self.open_senders):
            if s is keep:
                continue
            try:
                s.send(flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            except Exception as exc:  # a sender of a vanished client
                log.debug("live: closing a sender failed: %s", exc)
            self.open_senders.remove(s)
        if not keep_current:
            self.sender = None


class LiveSessions:
    """The sessions of one live model instance (see the module docstring).

    ``pb``: ``triton_python_backend_utils``; ``handler(ctx)``: runs one session (in its worker thread);
    ``input_names``: the model's inputs (read from every request).
    """

    def __init__(self, pb, handler: Callable[[LiveContext], Any], input_names: Iterable[str], *, max_sessions: int,
                 max_queued: int, idle_timeout_s: float, advance: str = "pull", on_idle: str = "close",
                 name: str = "live", on_change: Callable[[int], object] | None = None, remember: int = 1024,
                 sweep_s: float | None = None):
        if max_sessions < 1 or max_queued < 1 or not idle_timeout_s > 0:
            raise ValueError(f"need max_sessions >= 1, max_queued >= 1, idle_timeout_s > 0; got {max_sessions}, "
                             f"{max_queued}, {idle_timeout_s}")
        if advance not in ("pull", "arrival") or on_idle not in ("close", "end"):
            raise ValueError(f"advance must be pull or arrival, on_idle close or end; got {advance}, {on_idle}")
        self.pb, self.handler, self.inputs, self.name = pb, handler, list(input_names), name
        self.max_sessions, self.max_queued = int(max_sessions), int(max_queued)
        self.idle_timeout_s, self.advance, self.on_idle = float(idle_timeout_s), advance, on_idle
        self.sweep_s = float(sweep_s if sweep_s is not None else min(1.0, self.idle_timeout_s / 4))
        self.on_change = on_change or (lambda n: None)
        self.lock = threading.Lock()
        self.sessions: dict[Any, LiveContext] = {}
        self.outcomes: collections.OrderedDict[Any, str] = collections.OrderedDict()
        self.remember = int(remember)
        self.counts = collections.Counter()
        self.stopping = threading.Event()
        self.sweeper = threading.Thread(target=self._sweep, name=f"{name}-sweep", daemon=True)
        self.sweeper.start()

    @property
    def active(self) -> int:
        with self.lock:
            return len(self.sessions)

    # ------------------------------------------------------------------------------------------ execute()
    def submit(self, request) -> None:
        """Take one request of ``execute()``: start a session, queue a piece, or refuse it at once."""
        from . import triton_io

        pb = self.pb
        sender = request.get_response_sender()
        try:
            key = self._key(request)
            flags = int(request.flags())
            tensors = triton_io.read_inputs(pb, request, self.inputs)
            if flags & _START:
                self._start(key, request, sender, tensors, bool(flags & _END))
            else:
                self._queue(key, request, sender, tensors, bool(flags & _END))
        except _Refused as exc:
            self.counts[f"refused_{exc.code.lower()}"] += 1
            sender.send(error_response(pb, exc.code, str(exc)), flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        except Exception as exc:
            self.counts["refused_unreadable"] += 1
            sender.send(exception_response(pb, exc), flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def _key(self, request):
        key = request.correlation_id()
        if key in (0, "", None):
            raise _Refused(f"{self.name}: a live stream needs a sequence id (gRPC stream, sequence_id, "
                           "sequence_start on the first piece, sequence_end on the last)", "INVALID_ARG")
        return key

    def _start(self, key, request, sender, tensors, end: bool) -> None:
        from . import triton_io

        with self.lock:
            if key in self.sessions:
                raise _Refused(f"{self.name}: session {key!r} is already live; a sequence id names one stream at a "
                               "time (end it first, or use another id)", "INVALID_ARG")
            if len(self.sessions) >= self.max_sessions:
                self.outcomes[key] = "was refused at its start (too many live sessions)"
                raise _Refused(f"{self.name}: too many live sessions ({self.max_sessions}, the configured maximum); "
                               "retry later", "UNAVAILABLE")
            ctx = LiveContext(self, key, tensors, triton_io.request_parameters(request))
            ctx.queue.append(_Piece(request, sender, tensors, end))
            ctx.received = 1
            if self.advance == "arrival":
                ctx.sender = sender
                ctx.open_senders.append(sender)
            self.sessions[key] = ctx
            self.outcomes.pop(key, None)
            n = len(self.sessions)
        self.counts["started"] += 1
        self.on_change(n)
        ctx.worker = threading.Thread(target=self._run, args=(ctx,), name=f"{self.name}-{key}", daemon=True)
        ctx.worker.start()

    def _queue(self, key, request, sender, tensors, end: bool) -> None:
        with self.lock:
            ctx = self.sessions.get(key)
            outcome = self.outcomes.get(key)
        if ctx is None:
            if outcome == _FINISHED and end:
                sender.send(flags=self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                return
            why = f"it {outcome}" if outcome else "it was never started (the first piece needs sequence_start)"
            raise _Refused(f"{self.name}: no live session {key!r}: {why}", "INVALID_ARG")
        with ctx.cond:
            if ctx.ended_by == "finished" and end:
                sender.send(flags=self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)  # nothing of the client's is lost
                return
            if ctx.ended_by:
                raise _Refused(f"{self.name}: session {key!r} has ended ({ctx.ended_by}); no more pieces are taken",
                               "INVALID_ARG")
            if len(ctx.queue) >= self.max_queued:
                raise _Refused(f"{self.name}: session {key!r} has {len(ctx.queue)} pieces waiting, the most it keeps: "
                               "the input arrives faster than it is converted; send it at real time (this piece "
                               "was not taken; it may be sent again)", "UNAVAILABLE")
            ctx.queue.append(_Piece(request, sender, tensors, end))
            ctx.received += 1
            ctx.last_activity = time.monotonic()
            if self.advance == "arrival":
                ctx.sender = sender
                ctx.open_senders.append(sender)
                ctx._close_senders(keep_current=True)
            ctx.cond.notify_all()

    # ------------------------------------------------------------------------------------------ worker
    def _run(self, ctx: LiveContext) -> None:
        pb, final = self.pb, self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        outcome = "ended"
        try:
            self.handler(ctx)
            with ctx.cond:
                ctx.ended_by = ctx.ended_by or "finished"  # the model ended the session before its END came
            if ctx.ended_by == "finished":
                outcome = _FINISHED
            elif ctx.ended_by == "idle":
                outcome = f"was freed after {self.idle_timeout_s:g} s without a piece (idle timeout)"
            elif ctx.ended_by == "closed":
                outcome = "was closed (the model is unloading)"
        except StreamCancelled as exc:
            outcome = "was cancelled (the client went away)"
            self.counts["cancelled"] += 1
            with ctx.cond:
                if ctx.sender is not None:
                    ctx.sender.send(exception_response(pb, exc), flags=final)
                    ctx.open_senders.remove(ctx.sender) if ctx.sender in ctx.open_senders else None
                    ctx.sender = None
        except Exception as exc:
            client = isinstance(exc, CosyVoiceError)
            outcome = f"failed: {exc}" if client else f"failed (internal error: {type(exc).__name__})"
            self.counts["failed_input" if client else "failed"] += 1
            with ctx.cond:
                if ctx.sender is not None:
                    ctx.sender.send(exception_response(pb, exc), flags=final)
                    ctx.open_senders.remove(ctx.sender) if ctx.sender in ctx.open_senders else None
                    ctx.sender = None
        finally:
            self._free(ctx, outcome)

    def _free(self, ctx: LiveContext, outcome: str) -> None:
        pb = self.pb
        with ctx.cond:
            ctx.ended_by = ctx.ended_by or "closed"
            ctx._close_senders(keep_current=False)
            left = list(ctx.queue)
            ctx.queue.clear()
        for piece in left:  # pieces that arrived after the end or the failure
            try:
                if piece.end and outcome == _FINISHED:  # the client closing a session the model ended: no error
                    piece.sender.send(flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                    continue
                piece.sender.send(error_response(pb, "INVALID_ARG", f"{self.name}: session {ctx.key!r} {outcome}; "
                                                 "this piece was not taken"),
                                  flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            except Exception as exc:
                log.debug("live: answering a left-over piece failed: %s", exc)
        with self.lock:
            if self.sessions.get(ctx.key) is ctx:
                del self.sessions[ctx.key]
            self.outcomes[ctx.key] = outcome
            while len(self.outcomes) > self.remember:
                self.outcomes.popitem(last=False)
            n = len(self.sessions)
        self.counts["freed"] += 1
        self.on_change(n)

    # ------------------------------------------------------------------------------------------ idle sweep
    def _sweep(self) -> None:
        while not self.stopping.wait(self.sweep_s):
            now = time.monotonic()
            with self.lock:
                sessions = list(self.sessions.values())
            for ctx in sessions:
                with ctx.cond:
                    if ctx.ended_by:
                        continue
                    idle = not ctx.busy and not ctx.queue and now - ctx.last_activity > self.idle_timeout_s
                    gone = False
                    if not idle and not ctx.busy:
                        gone = ctx._any_cancelled()
                    if idle or gone:
                        ctx.ended_by = "cancelled" if gone else "idle"
                        self.counts["idle" if idle else "vanished"] += 1
                        ctx.cond.notify_all()

    def close(self, wait_s: float = 0.0) -> None:
        """Stop every session (``finalize()``): their pieces end (``ended_by`` "closed"); then wait up to
        ``wait_s`` seconds for their workers to return (each closes its senders)."""
        self.stopping.set()
        with self.lock:
            sessions = list(self.sessions.values())
        for ctx in sessions:
            with ctx.cond:
                ctx.ended_by = ctx.ended_by or "closed"
                ctx.cond.notify_all()
        deadline = time.monotonic() + wait_s
        for ctx in sessions:
            if ctx.worker is not None and wait_s > 0:
                ctx.worker.join(max(0.0, deadline - time.monotonic()))

    def snapshot(self) -> dict[str, Any]:
        """Counts and the live sessions (for logs and tests)."""
        with self.lock:
            return {"active": len(self.sessions), **dict(self.counts)}


class SessionGauge:
    """``cosyvoice_live_sessions{model, version}``: the live sessions of a model instance (a Triton gauge)."""

    NAME = "cosyvoice_live_sessions"

    def __init__(self, pb, model: str, version: str | int):
        self.family = pb.MetricFamily(name=self.NAME, description="live sessions held by the model (freed when "
                                      "a stream ends, is cancelled or goes idle)", kind=pb.MetricFamily.GAUGE)
        self.metric = self.family.Metric(labels={"model": model, "version": str(version)})

    def __call__(self, active: int) -> None:
        try:
            self.metric.set(float(active))
        except Exception as exc:  # metrics must never fail a stream
            log.warning("live: the session gauge failed: %s", exc)
