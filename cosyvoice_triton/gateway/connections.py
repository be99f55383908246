"""The gateway's HTTP connections against slow and idle clients: uvicorn's h11 protocol with deadlines and a cap.

uvicorn bounds only the time between requests (``timeout_keep_alive``): a connection that never finishes its
request head, or its body, stays open, as does one whose chunk header announces more bytes than any body may
have. Here each connection is read within deadlines, and a port holds at most so many connections:

- the request head within ``header_timeout_s`` of the connection's start or of the previous answer;
- the body within ``body_timeout_s`` of its head (a chunk size over the body cap: 400 at once);
- ``max_connections`` open on the port: a new one closes the oldest that has not sent a request head yet (idle or
  trickling), or is answered 503 and closed when every connection is in a request.

A deadline missed is answered 408 (unless the answer had already started) and the connection closed.
:func:`serve` runs an app under uvicorn with these and the gateway's other connection settings."""

from __future__ import annotations

import time

import h11
import uvicorn
from h11._readers import ChunkedReader
from uvicorn.protocols.http.h11_impl import STATUS_PHRASES, H11Protocol

from .config import GatewayConfig
from .errors import error_bytes


def protocol(config: GatewayConfig) -> type[H11Protocol]:
    """uvicorn's h11 protocol bound to ``config``'s deadlines, connection cap and body cap."""

    class GatewayProtocol(H11Protocol):
        header_timeout_s, body_timeout_s = config.header_timeout_s, config.body_timeout_s
        max_connections, max_body_bytes = config.max_connections, config.max_body_bytes

        def connection_made(self, transport) -> None:
            self._phase, self._timer, self._since = None, None, time.monotonic()
            super().connection_made(transport)
            if self.max_connections and len(self.connections) > self.max_connections:
                waiting = [c for c in self.connections if c is not self and getattr(c, "_phase", None) == "head"]
                if waiting:
                    min(waiting, key=lambda c: c._since).cut(None, "")
                else:
                    self.cut(503, f"the gateway holds {self.max_connections} connections; try again",
                             "too_many_connections")
                    return
            self._watch()

        def connection_lost(self, exc) -> None:
            self._arm(None)
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            reader = self.conn._reader  # h11's: the size of the chunk it is reading is only there
            if isinstance(reader, ChunkedReader) and reader._bytes_in_chunk > self.max_body_bytes:
                return self.cut(400, f"a chunk of {reader._bytes_in_chunk} bytes; a body has at most "
                                     f"{self.max_body_bytes}", "chunk_too_large")
            self._watch()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._watch()

        def _watch(self) -> None:
            """The deadline of what the connection waits for now: a request head, the rest of a body, or none."""
            state = self.conn.their_state
            phase = "head" if state is h11.IDLE else "body" if state is h11.SEND_BODY else None
            if phase != self._phase and not self.transport.is_closing():
                self._phase, self._since = phase, time.monotonic()
                self._arm({"head": self.header_timeout_s, "body": self.body_timeout_s}.get(phase))

        def _arm(self, seconds: float | None) -> None:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = None if not seconds else self.loop.call_later(seconds, self._expired, self._phase)

        def _expired(self, phase: str) -> None:
            what = "request head" if phase == "head" else "request body"
            limit = self.header_timeout_s if phase == "head" else self.body_timeout_s
            self.cut(408, f"the {what} did not arrive within {limit:g} s", "request_timeout")

        def cut(self, status: int | None, message: str, code: str = "") -> None:
            """Answer ``status`` (none: silently, or when the answer has started) and close the connection; the
            request's app, if any, sees the client leave."""
            self._arm(None)
            self._phase = "closed"
            cycle = self.cycle
            started = cycle is not None and cycle.response_started
            if cycle is not None and not cycle.response_complete:
                cycle.disconnected = True
                cycle.message_event.set()
            if status is not None and not started and not self.transport.is_closing():
                body = error_bytes(status, message, code=code)
                self.transport.write(b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                                     b"connection: close\r\n\r\n%s" % (status, STATUS_PHRASES[status], len(body), body))
            self.transport.close()

    return GatewayProtocol


def serve(app, config: GatewayConfig, **kwargs) -> None:
    """``app`` under uvicorn on ``config.host:config.port`` with the gateway's protocol (h11: the pure-Python parser
    whose framing checks the tests exercise); a WebSocket message (the live sessions, :mod:`.live_ws`) over the
    body cap closes its socket (1009), and a socket whose client stops answering pings is closed."""
    uvicorn.run(app, host=config.host, port=config.port, http=protocol(config),
                timeout_keep_alive=config.keep_alive_s, ws_max_size=config.max_body_bytes, **kwargs)
