"""Sequence ids per tenant at the KServe entry points. A request's ``sequence_id`` (Triton's correlation id: the
live models' session, with ``sequence_start`` / ``sequence_end``) names a sequence of the caller's tenant only:
:class:`SequenceIds` maps (tenant, model, the client's id) to an id the gateway draws itself, and Triton sees only
that one. So another tenant's id is, for the caller, an id nobody opened: a piece without a start is refused as any
unknown id is (by Triton, which never saw it), an end ends nothing, a start opens the caller's own session.

* The drawn id has the client's kind: an integer in [2**32, 2**63) for an integer id (tritonclient's gRPC sends an
  int64), ``gw`` + 32 hex digits for a string id, drawn at random (several gateways may share one Triton).
* A start opens an entry (or takes the tenant's open one for that id: Triton then answers "already live" as it
  would); a request with the end closes it. A closed entry is remembered a while (not counted as open), so a late
  piece or an end sent again reaches the same sequence and gets Triton's own answer for it; a start reopens it.
  A request without a start on an id the tenant has not opened gets a fresh id that is never kept.
* Bounds: at most ``max_open`` open entries in all, ``max_per_tenant`` per tenant and ``per_model[model]`` per
  tenant on one model (a live model's share: below its own ``max_sessions``, so one key cannot take them all; a
  start beyond is refused with 429, naming the bound), each forgotten after ``idle_s`` without a request (keep it
  at least the live models' idle time, ``live_idle_timeout_s`` + 5 s: Triton's own); as many closed entries as
  ``max_open``, the oldest forgotten first.
* Answers come back with the client's id: :class:`Names` (one a call or a stream) replaces the drawn ids in
  error messages and in a ``sequence_id`` response parameter.

A gateway without keys has one tenant: it passes the ids through unchanged (no table)."""

from __future__ import annotations

import collections
import json
import re
import secrets
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .errors import GatewayError

SEQUENCE_ID, SEQUENCE_START, SEQUENCE_END = "sequence_id", "sequence_start", "sequence_end"
_LOW, _HIGH = 2**32, 2**63
_STRING_PREFIX = "gw"
#: A drawn id in a message: 10-19 digits (at least 2**32) or ``gw`` + 32 hex digits.
_DRAWN = re.compile(r"(?<![0-9A-Za-z])(?:\d{10,19}|gw[0-9a-f]{32})(?![0-9A-Za-z])")
#: Drawn ids one :class:`Names` keeps (a stream's most recent).
NAMES_KEPT = 1024

ClientId = int | str


def is_sequence(value: Any) -> bool:
    """Whether ``value`` names a sequence (Triton: 0 and "" are no sequence)."""
    return value not in (0, "", None) and not isinstance(value, bool)


def grpc_sequence(request) -> tuple[ClientId, bool, bool] | None:
    """A ``ModelInferRequest``'s sequence: ``(id, start, end)``, the flags true only as ``bool_param``; None
    when it names none."""
    params = request.parameters
    if SEQUENCE_ID not in params:
        return None
    which = params[SEQUENCE_ID].WhichOneof("parameter_choice")
    client = getattr(params[SEQUENCE_ID], which) if which else None
    if not is_sequence(client):
        return None

    def flag(name: str) -> bool:
        return name in params and params[name].WhichOneof("parameter_choice") == "bool_param" \
            and params[name].bool_param

    return client, flag(SEQUENCE_START), flag(SEQUENCE_END)


@dataclass
class _Entry:
    upstream: ClientId
    tenant: str
    last: float
    model: str = ""


class SequenceIds:
    """The table of (tenant, model, client id) -> drawn id; thread-safe."""

    def __init__(self, max_open: int = 1024, max_per_tenant: int = 64, idle_s: float = 35.0, *,
                 per_model: Mapping[str, int] | None = None, clock: Callable[[], float] = time.monotonic):
        per_model = dict(per_model or {})
        if max_open < 1 or max_per_tenant < 1 or not idle_s > 0 or any(n < 1 for n in per_model.values()):
            raise ValueError("sequence ids: max_open, max_per_tenant and each per-model share must be >= 1, "
                             "idle_s > 0")
        self.max_open, self.max_per_tenant, self.idle_s, self._clock = max_open, max_per_tenant, idle_s, clock
        self.per_model = per_model  # model -> the open sequences one tenant may hold on it
        self._per_tenant_model: collections.Counter[tuple[str, str]] = collections.Counter()
        self._open: collections.OrderedDict[tuple, _Entry] = collections.OrderedDict()  # least recently used first
        self._closed: collections.OrderedDict[tuple, _Entry] = collections.OrderedDict()
        self._per_tenant: collections.Counter[str] = collections.Counter()
        self._drawn: set[ClientId] = set()  # the ids of both tables
        self._lock = threading.Lock()

    # ---------------------------------------------------------------------------------------------- mapping
    def upstream(self, tenant: str, model: str, client: ClientId, *, start: bool = False, end: bool = False
                 ) -> ClientId:
        """The id Triton gets for the tenant's request on ``client`` (with its flags); 429 for a start beyond
        the bounds."""
        key = (tenant, model, isinstance(client, str), client)  # 5 and "5" are two ids, as for Triton
        with self._lock:
            now = self._clock()
            self._expire(now)
            entry = self._open.get(key)
            if entry is None and start:
                entry = self._opened(key, tenant, client, now)
            if entry is None:  # not open: closed a while ago, else an id this tenant has no sequence for
                closed = self._closed.get(key)
                if closed is None:
                    return self._draw(client)
                closed.last = now
                self._closed.move_to_end(key)
                return closed.upstream
            entry.last = now
            self._open.move_to_end(key)
            if end:
                self._close(key)
            return entry.upstream

    def _opened(self, key: tuple, tenant: str, client: ClientId, now: float) -> _Entry:
        if self._per_tenant[tenant] >= self.max_per_tenant:
            raise GatewayError(429, f"too many open sequences for this tenant (at most {self.max_per_tenant}): "
                               "end one (sequence_end) first, or wait until one has been idle for "
                               f"{self.idle_s:g} s", code="too_many_sequences", param=SEQUENCE_ID)
        model = key[1]
        share = self.per_model.get(model)
        if share is not None and self._per_tenant_model[(tenant, model)] >= share:
            raise GatewayError(429, f"too many open sessions of {model} for this tenant (at most {share}, "
                               "--live-sessions-per-tenant): end one (sequence_end) first, or wait until one has "
                               f"been idle for {self.idle_s:g} s", code="too_many_sequences", param=SEQUENCE_ID)
        if len(self._open) >= self.max_open:
            raise GatewayError(429, f"the gateway holds {self.max_open} open sequences, its most; retry later",
                               code="too_many_sequences", param=SEQUENCE_ID, headers={"retry-after": "1"})
        entry = self._closed.pop(key, None) or _Entry(self._draw(client, keep=True), tenant, now, model)
        entry.last = now
        self._open[key] = entry
        self._per_tenant[tenant] += 1
        self._per_tenant_model[(tenant, model)] += 1
        return entry

    def _close(self, key: tuple) -> None:
        entry = self._open.pop(key)
        self._forget_tenant(entry.tenant, entry.model)
        self._closed[key] = entry
        while len(self._closed) > self.max_open:
            _, old = self._closed.popitem(last=False)
            self._drawn.discard(old.upstream)

    def _forget_tenant(self, tenant: str, model: str = "") -> None:
        self._per_tenant[tenant] -= 1
        if self._per_tenant[tenant] <= 0:
            del self._per_tenant[tenant]
        self._per_tenant_model[(tenant, model)] -= 1
        if self._per_tenant_model[(tenant, model)] <= 0:
            del self._per_tenant_model[(tenant, model)]

    def _expire(self, now: float) -> None:
        for table in (self._open, self._closed):
            while table:
                key, entry = next(iter(table.items()))
                if now - entry.last < self.idle_s:
                    break
                del table[key]
                self._drawn.discard(entry.upstream)
                if table is self._open:
                    self._forget_tenant(entry.tenant, entry.model)

    def _draw(self, client: ClientId, keep: bool = False) -> ClientId:
        while True:
            drawn = (f"{_STRING_PREFIX}{secrets.token_hex(16)}" if isinstance(client, str)
                     else _LOW + secrets.randbelow(_HIGH - _LOW))
            if drawn not in self._drawn:
                if keep:
                    self._drawn.add(drawn)
                return drawn

    # ------------------------------------------------------------------------------------------------ state
    def is_open(self, tenant: str, model: str, client: ClientId) -> bool:
        """Whether the tenant holds an open sequence ``client`` on ``model`` (idle ones forgotten first)."""
        with self._lock:
            self._expire(self._clock())
            return (tenant, model, isinstance(client, str), client) in self._open

    def open_count(self, tenant: str | None = None) -> int:
        """Open entries (of ``tenant``; None: all), idle ones forgotten first."""
        with self._lock:
            self._expire(self._clock())
            return len(self._open) if tenant is None else self._per_tenant.get(tenant, 0)

    def closed_count(self) -> int:
        with self._lock:
            self._expire(self._clock())
            return len(self._closed)


class Names:
    """The drawn ids of one call or stream -> the client's, to give answers back in the client's terms."""

    def __init__(self, kept: int = NAMES_KEPT):
        self._names: collections.OrderedDict[ClientId, ClientId] = collections.OrderedDict()
        self._kept = kept

    def __bool__(self) -> bool:
        return bool(self._names)

    def add(self, upstream: ClientId, client: ClientId) -> None:
        self._names[upstream] = client
        self._names.move_to_end(upstream)
        while len(self._names) > self._kept:
            self._names.popitem(last=False)

    def client(self, upstream: Any) -> Any:
        """The client's id of a drawn one (anything else as it is)."""
        try:
            return self._names.get(upstream, upstream)
        except TypeError:  # unhashable: not an id
            return upstream

    def text(self, message: str) -> str:
        """``message`` with each drawn id this call knows written as the client's."""
        if not self._names or not message:
            return message

        def one(m: re.Match) -> str:
            drawn = m.group()
            key: ClientId = drawn if drawn.startswith(_STRING_PREFIX) else int(drawn)
            return str(self._names[key]) if key in self._names else drawn

        return _DRAWN.sub(one, message)


class Scope:
    """The sequence ids of one tenant's call or stream: requests' ids to the drawn ones on the way in
    (:meth:`json_parameters`, :meth:`grpc_request`), answers back on the way out. ``table`` None: pass-through."""

    def __init__(self, table: SequenceIds | None, tenant: str | None):
        self.table, self.tenant, self.names = table, tenant, Names()

    @property
    def active(self) -> bool:
        return self.table is not None and self.tenant is not None

    def _upstream(self, model: str, client: Any, start: Any, end: Any) -> ClientId:
        drawn = self.table.upstream(self.tenant, model, client, start=start is True, end=end is True)
        self.names.add(drawn, client)
        return drawn

    # -------------------------------------------------------------------------------------- HTTP (JSON)
    def json_parameters(self, model: str, params: dict[str, Any]) -> dict[str, Any]:
        """A request's checked ``parameters`` as Triton gets them."""
        client = params.get(SEQUENCE_ID)
        if not self.active or not is_sequence(client):
            return params
        return {**params, SEQUENCE_ID: self._upstream(model, client, params.get(SEQUENCE_START),
                                                      params.get(SEQUENCE_END))}

    def http_answer(self, body: bytes, header_length: str | None) -> tuple[bytes, str | None]:
        """Triton's HTTP answer (JSON, or JSON then binary outputs: ``header_length`` bytes of JSON) with the
        client's id in its parameters and messages."""
        if not self.names:
            return body, header_length
        split = int(header_length) if header_length is not None and header_length.isdigit() else len(body)
        try:
            head = json.loads(body[:split])
        except ValueError:
            return body, header_length
        if not isinstance(head, dict):
            return body, header_length
        params = head.get("parameters")
        if isinstance(params, dict) and SEQUENCE_ID in params:
            params[SEQUENCE_ID] = self.names.client(params[SEQUENCE_ID])
        if isinstance(head.get("error"), str):
            head["error"] = self.names.text(head["error"])
        new = json.dumps(head, separators=(",", ":")).encode()
        return new + body[split:], (None if header_length is None else str(len(new)))

    # ----------------------------------------------------------------------------------------------- gRPC
    def continues(self, request) -> bool:
        """Whether a ``ModelInferRequest`` goes on a sequence this tenant holds open (an id without the start
        flag): a piece of an admitted session (see ``KServeProxy``'s admission)."""
        seq = grpc_sequence(request) if self.active else None
        return seq is not None and not seq[1] and self.table.is_open(self.tenant, request.model_name, seq[0])

    def grpc_request(self, request) -> None:
        """A checked ``ModelInferRequest`` (the gateway's own copy), its ``sequence_id`` made Triton's."""
        seq = grpc_sequence(request) if self.active else None
        if seq is None:
            return
        drawn = self._upstream(request.model_name, *seq)
        params = request.parameters
        if isinstance(drawn, str):
            params[SEQUENCE_ID].string_param = drawn
        else:
            params[SEQUENCE_ID].int64_param = drawn

    def grpc_response(self, response):
        """A ``ModelInferResponse`` with the client's id (the same object when nothing names a drawn id)."""
        if not self.names or SEQUENCE_ID not in response.parameters:
            return response
        p = response.parameters[SEQUENCE_ID]
        which = p.WhichOneof("parameter_choice")
        client = self.names.client(getattr(p, which)) if which else None
        if client is None or (which and client == getattr(p, which)):
            return response
        out = type(response)()
        out.CopyFrom(response)
        if isinstance(client, str):
            out.parameters[SEQUENCE_ID].string_param = client
        elif client < 2**63:
            out.parameters[SEQUENCE_ID].int64_param = client
        else:
            out.parameters[SEQUENCE_ID].uint64_param = client
        return out

    def grpc_stream_answer(self, answer):
        """A ``ModelStreamInferResponse`` with the client's id in its error message and response."""
        if not self.names:
            return answer
        message = self.names.text(answer.error_message)
        response = self.grpc_response(answer.infer_response)
        if message == answer.error_message and response is answer.infer_response:
            return answer
        out = type(answer)()
        out.CopyFrom(answer)
        out.error_message = message
        if response is not answer.infer_response:
            out.infer_response.CopyFrom(response)
        return out
