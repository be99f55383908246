"""Slow and idle clients at the real gateway (uvicorn with :mod:`cosyvoice_triton.gateway.connections`, in a process
of its own, on the fake speech backend of ``test_gateway_linear``), with short deadlines so that the tests are quick:

- request heads trickled a line at a time are answered 408 and closed at the header deadline, not before; a body
  trickled likewise at the body deadline; a chunk size of ``ffffffffffffffff`` gets 400 and closed at once;
- the HTTP port holds at most ``max_connections``: idle connections beyond it push the oldest idle ones out while an
  innocent request is answered, and a connection beyond the cap when every connection is in a request gets 503;
- the gRPC port closes a silent connection at the handshake deadline.

Each cut is measured from the client's side against a generous ceiling (busy machines), never a fixed deadline."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import httpx2 as httpx
import pytest
import test_gateway_linear as linear
from conftest import PATIENCE_S, gateway_running, wait_until

HEADER_S, BODY_S, CAP = 2.0, 8.0, 12
_TAIL = "\nport = int(sys.argv[1])"
assert _TAIL in linear.SERVER
SERVER = linear.SERVER.rpartition(_TAIL)[0] + f"""
from cosyvoice_triton.gateway.connections import serve

port, grpc_port = int(sys.argv[1]), int(sys.argv[2])
config = GatewayConfig(port=port, grpc_port=grpc_port, api_keys=frozenset({{"attacker-key", "other-key"}}),
                       header_timeout_s={HEADER_S}, body_timeout_s={BODY_S}, max_connections={CAP}, keep_alive_s=30)
serve(create_app(config, Backend()), config, log_level="warning")
"""
KEY = b"authorization: Bearer attacker-key\r\n"


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    from cosyvoice_triton.serving.launch.server import free_ports

    ports = free_ports(2)
    log = tmp_path_factory.mktemp("gateway") / "gateway.log"
    with gateway_running(["-c", SERVER, *map(str, ports)], log, f"127.0.0.1:{ports[0]}"):
        yield ports


def _connect(port: int, first: bytes = b"") -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=PATIENCE_S)
    if first:
        sock.sendall(first)
    return sock


def _until_closed(sock: socket.socket, trickle: bytes = b"", every_s: float = 0.25) -> tuple[bytes, float]:
    """What the server sends until it closes the connection, and when it closed (``time.monotonic``); meanwhile
    ``trickle`` is sent a byte-run at a time, every ``every_s``."""
    got = b""
    sock.settimeout(every_s if trickle else PATIENCE_S)
    deadline = time.monotonic() + PATIENCE_S
    while time.monotonic() < deadline:
        try:
            data = sock.recv(65536)
        except TimeoutError:
            with contextlib.suppress(OSError):
                sock.sendall(trickle)
            continue
        except ConnectionResetError:
            return got, time.monotonic()
        if not data:
            return got, time.monotonic()
        got += data
    pytest.fail(f"the connection was still open after {PATIENCE_S:.0f} s (got {got[:200]!r})")


def _closed_now(sock: socket.socket) -> bool:
    """Whether the server has closed ``sock`` (what it sent before is dropped)."""
    sock.setblocking(False)
    try:
        while True:
            if not sock.recv(65536):
                return True
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True
    finally:
        sock.setblocking(True)


def _status(raw: bytes) -> int:
    return int(raw.split(b" ", 2)[1]) if raw.startswith(b"HTTP/1.1 ") else 0


def test_trickled_request_heads_are_cut_at_the_header_deadline(gateway):
    port, _ = gateway
    results: list[tuple[bytes, float]] = []
    t0 = time.monotonic()
    socks = [_connect(port, b"POST /v1/audio/speech HTTP/1.1\r\nhost: x\r\n") for _ in range(CAP - 2)]

    def watch(sock):
        results.append(_until_closed(sock, trickle=b"x-a: b\r\n"))

    threads = [threading.Thread(target=watch, args=(s,)) for s in socks]
    for t in threads:
        t.start()
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=PATIENCE_S) as client:
            assert client.get("/health").status_code == 200  # an innocent request meanwhile
        for t in threads:
            t.join()
    finally:
        for s in socks:
            s.close()
    times = sorted(at - t0 for _, at in results)
    print(f"{len(results)} trickled heads cut after {times[0]:.2f}..{times[-1]:.2f} s (deadline {HEADER_S} s)")
    assert len(results) == len(socks)
    for raw, at in results:
        assert _status(raw) == 408 and b"request head did not arrive within 2 s" in raw, raw[:300]
        assert at - t0 >= HEADER_S * 0.95


def test_a_trickled_body_is_cut_at_the_body_deadline(gateway):
    port, _ = gateway
    t0 = time.monotonic()
    sock = _connect(port, b"POST /v1/audio/speech HTTP/1.1\r\nhost: x\r\n" + KEY +
                    b"content-type: application/json\r\ncontent-length: 100000\r\n\r\n{")
    try:
        raw, at = _until_closed(sock, trickle=b" ")
    finally:
        sock.close()
    print(f"a trickled body cut after {at - t0:.2f} s (deadline {BODY_S} s)")
    assert _status(raw) == 408 and b"request body did not arrive within 8 s" in raw, raw[:300]
    assert at - t0 >= BODY_S * 0.95


def test_an_absurd_chunk_size_is_a_400_and_closed_at_once(gateway):
    port, _ = gateway
    for path in (b"/v1/audio/speech", b"/v2/models/cosyvoice_vc/infer", b"/health"):
        t0 = time.monotonic()
        sock = _connect(port, b"POST " + path + b" HTTP/1.1\r\nhost: x\r\n" + KEY +
                        b"transfer-encoding: chunked\r\n\r\nffffffffffffffff\r\nabc")
        try:
            raw, at = _until_closed(sock)
        finally:
            sock.close()
        print(f"{path.decode()}: chunk size ffffffffffffffff answered {_status(raw)} in {at - t0:.3f} s")
        assert _status(raw) == 400 and b"chunk_too_large" in raw, raw[:300]
        assert at - t0 < BODY_S  # not the deadline: at once


def _new_connection_answer(port: int) -> bytes:
    """What a fresh connection that sends nothing gets before it is closed."""
    with _connect(port) as sock:
        return _until_closed(sock)[0]


def test_idle_connections_beyond_the_cap_push_out_the_oldest_idle_while_requests_are_answered(gateway):
    port, _ = gateway
    socks = []
    try:
        for i in range(3 * CAP):
            socks.append(_connect(port))
            if i % CAP == CAP - 1:  # the port is full of idle connections: an innocent request on a new one
                with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=PATIENCE_S) as client:
                    assert client.get("/health").status_code == 200
        left = sum(not _closed_now(s) for s in socks)
        print(f"{len(socks)} idle connections opened, {left} left open (cap {CAP})")
        assert left <= CAP
    finally:
        for s in socks:
            s.close()


def test_connections_beyond_the_cap_are_refused_when_all_are_in_requests(gateway):
    """The port full of connections whose bodies have not arrived (answered 401 at their head: a body left unread
    holds the connection until its deadline): a new connection gets 503, until the body deadline frees them."""
    port, _ = gateway
    head = b"POST /v1/audio/speech HTTP/1.1\r\nhost: x\r\nauthorization: Bearer nobody\r\ncontent-length: 1000\r\n\r\n{"
    socks = []
    try:
        for _ in range(CAP):
            socks.append(_connect(port, head))
            assert _status(socks[-1].recv(12)) == 401  # the server has read its head
        raw = _new_connection_answer(port)
        assert _status(raw) == 503 and b"too_many_connections" in raw, raw[:300]
        # the busy ones reach their body deadline: the port takes requests again
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=PATIENCE_S) as client:
            wait_until(lambda: _answered(client), "an innocent request answered after the body deadline")
    finally:
        for s in socks:
            s.close()


def _answered(client: httpx.Client) -> bool:
    try:
        return client.get("/health").status_code == 200
    except httpx.HTTPError:
        return False


def test_the_grpc_port_closes_silent_connections_at_the_handshake_deadline(gateway):
    """gRPC core closes a connection that has not done its HTTP/2 handshake within the header deadline (the cap,
    ``grpc.max_allowed_incoming_connections``, is asked for too; silent connections beyond it were not seen
    refused at once in grpcio 1.85: the handshake deadline is what bounds them)."""
    _, grpc_port = gateway
    t0 = time.monotonic()
    socks = [_connect(grpc_port) for _ in range(CAP + 3)]
    try:
        closed = [_until_closed(s)[1] - t0 for s in socks]
        print(f"gRPC: {len(socks)} silent connections closed after {min(closed):.2f}..{max(closed):.2f} s "
              f"(handshake deadline {HEADER_S} s)")
        assert min(closed) >= HEADER_S * 0.95
    finally:
        for s in socks:
            s.close()
