"""The HTTP side of the limits, as one pure ASGI middleware in front of the routes (streamed answers pass through
untouched): a request id (``x-request-id``, in every log line and answer), framing that two parsers could read
differently (Content-Length together with Transfer-Encoding: h11 accepts it and lets Transfer-Encoding win; a proxy
in front may not), compressed bodies and overlong Content-Types (415), the body size (413, Content-Length or counted
as a chunked body arrives), the API key (401) with its tenant (``request.state.tenant``), and the key's concurrency
and rate (429). Refusals are in OpenAI's error shape."""

from __future__ import annotations

import asyncio
import contextvars
import json
import logging
import re
import time
import uuid

from starlette.datastructures import Headers

from ..errors import shown
from .errors import GatewayError, error_bytes
from .limits import KeyLimiter, KeyRing
from .metrics import GatewayMetrics

log = logging.getLogger("cosyvoice_triton.gateway.access")

REQUEST_ID: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="-")
_CLIENT_ID = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
_BODY_METHODS = {"POST", "PUT", "PATCH"}
KSERVE = "/v2"  # the KServe routes: one metrics label, KServe-shaped refusals
#: The pieces the form routes get a buffered form body in (any other body is handed over whole).
FORM_PIECE_BYTES = 16 * 1024
#: The most ``&`` separators a URL-encoded form may hold (the form routes take at most four fields): the form parser
#: skips each extra one in Python with a log call, a second and more for a body of separators at the cap.
MAX_FORM_SEPARATORS = 1000
#: The longest Content-Type accepted (a form's is ~100 characters): the form parser reads it in quadratic time.
MAX_CONTENT_TYPE_CHARS = 1024


class RequestIdFilter(logging.Filter):
    """Puts the current request's id into each record as ``request_id`` (``-`` outside a request)."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = REQUEST_ID.get()
        return True


class GatewayMiddleware:
    """``limited``: the path prefixes behind the key, concurrency and rate checks, ``limited_paths`` the exact paths
    (``/v2`` itself, ``/metrics``); the others (``/health``, the listening page) are open."""

    def __init__(self, app, *, keys: KeyRing, limiter: KeyLimiter, metrics: GatewayMetrics, max_body_bytes: int,
                 routes: frozenset[str] = frozenset(), limited: tuple[str, ...] = ("/v1/",),
                 limited_paths: frozenset[str] = frozenset()):
        self.app, self.keys, self.limiter, self.metrics = app, keys, limiter, metrics
        self.max_body_bytes, self.routes, self.limited = int(max_body_bytes), routes, limited
        self.limited_paths = limited_paths

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = Headers(scope=scope)
        given = headers.get("x-request-id", "")
        rid = given if _CLIENT_ID.match(given) else uuid.uuid4().hex
        token = REQUEST_ID.set(rid)
        scope.setdefault("state", {})["request_id"] = rid
        answered = {"status": 0}

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                answered["status"] = message["status"]
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", rid.encode())]}
            await send(message)

        t0 = time.perf_counter()
        self.metrics.in_flight.inc()
        who = "-"
        try:
            who = await self._guarded(scope, headers, receive, send_with_id)
        finally:
            self.metrics.in_flight.dec()
            path = scope["path"]
            route = path if path in self.routes else KSERVE if path.startswith(KSERVE) else "other"
            self.metrics.requests.labels(route, str(answered["status"])).inc()
            log.info('%s "%s %s" %s %.1f ms %s', scope.get("client", ("-",))[0] if scope.get("client") else "-",
                     scope["method"], scope["path"], answered["status"], (time.perf_counter() - t0) * 1e3, who)
            REQUEST_ID.reset(token)

    async def _refuse(self, send, exc: GatewayError, *, close: bool = False, path: str = "") -> None:
        self.metrics.refused.labels(exc.code or str(exc.status)).inc()
        if path.startswith(KSERVE):  # Triton's clients read KServe's error shape
            body = json.dumps({"error": exc.message}).encode()
        else:
            body = error_bytes(exc.status, exc.message, code=exc.code, param=exc.param)
        out = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        out += [(k.encode(), v.encode()) for k, v in exc.headers.items()]
        if close:
            out.append((b"connection", b"close"))
        await send({"type": "http.response.start", "status": exc.status, "headers": out})
        await send({"type": "http.response.body", "body": body})

    async def _guarded(self, scope, headers: Headers, receive, send) -> str:
        """Check, then call the app; returns who asked (a key's id or the client's address) for the log."""
        try:
            self._check_framing(headers)
        except GatewayError as exc:
            await self._refuse(send, exc, close=True, path=scope["path"])
            return "-"
        if not scope["path"].startswith(self.limited) and scope["path"] not in self.limited_paths:
            await self.app(scope, receive, send)
            return "-"
        who = "-"
        try:
            if self.keys.enabled:
                who = self.keys.identify(headers.get("authorization"))
                scope["state"]["tenant"] = self.keys.tenant_of(who)  # the routes' Namespace (tenants.py)
            else:
                who = scope["client"][0] if scope.get("client") else "anonymous"
            # a GET may carry a body too (the official CosyVoice client sends its forms with GET); a request with
            # one is work for Triton and waits for its turn at the fair gate when the service is full
            work = scope["method"] in _BODY_METHODS or "transfer-encoding" in headers or \
                headers.get("content-length", "0") not in ("", "0")
            if work:
                await self.limiter.admit(who)
            else:
                self.limiter.acquire(who)
        except GatewayError as exc:
            await self._refuse(send, exc, path=scope["path"])
            return who
        try:
            if work:
                try:
                    body = await self._read_body(receive)
                except GatewayError as exc:
                    await self._refuse(send, exc, close=True, path=scope["path"])
                    return who
                if body is None:  # the client left
                    return who
                content_type = headers.get("content-type", "").lower()
                form = "form" in content_type  # multipart/form-data, x-www-form-urlencoded
                separators = body.count(b"&") if "x-www-form-urlencoded" in content_type else 0
                if separators > MAX_FORM_SEPARATORS:
                    await self._refuse(send, GatewayError(
                        400, f"the form holds {separators} '&' separators; at most {MAX_FORM_SEPARATORS} are "
                        "accepted", code="invalid_form"), close=True, path=scope["path"])
                    return who
                receive = _replay(body, receive, FORM_PIECE_BYTES if form else max(len(body), 1))
            await self.app(scope, receive, send)
        finally:
            (self.limiter.leave if work else self.limiter.release)(who)
        return who

    def _check_framing(self, headers: Headers) -> None:
        if "transfer-encoding" in headers and "content-length" in headers:
            raise GatewayError(400, "both Content-Length and Transfer-Encoding: ambiguous framing is refused",
                               code="ambiguous_framing")
        encoding = headers.get("content-encoding", "identity").strip().lower()
        if encoding not in ("", "identity"):
            raise GatewayError(415, f"Content-Encoding {shown(encoding)} is not accepted: send the body uncompressed",
                               code="unsupported_content_encoding")
        content_type = headers.get("content-type", "")
        if len(content_type) > MAX_CONTENT_TYPE_CHARS:
            raise GatewayError(415, f"a Content-Type of {len(content_type)} characters is not accepted; at most "
                               f"{MAX_CONTENT_TYPE_CHARS}", code="unsupported_content_type")
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            raise GatewayError(413, f"the body is {int(length)} bytes; at most {self.max_body_bytes} are accepted",
                               code="body_too_large")

    async def _read_body(self, receive) -> bytes | None:
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                raise GatewayError(413, f"the body is over {self.max_body_bytes} bytes", code="body_too_large")
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


def _replay(body: bytes, receive, piece: int):
    """A ``receive`` that hands the app the body already read, in pieces of ``piece`` bytes with a turn of the event
    loop between them, then the connection's own messages (disconnect). The form parser works on each piece as it
    comes, in Python: a crafted form at the body cap (every byte a separator) takes seconds, which other requests
    then share instead of waiting them out."""
    at, done = 0, False

    async def replay():
        nonlocal at, done
        if done:
            return await receive()
        if at:
            await asyncio.sleep(0)
        chunk = body[at: at + piece]
        at += piece
        done = at >= len(body)
        return {"type": "http.request", "body": chunk, "more_body": not done}

    return replay
