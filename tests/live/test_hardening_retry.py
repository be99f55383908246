"""Client retries against fake servers in this process: an HTTP server and a gRPC server (Triton's own protocol
from ``tritonclient.grpc``) that fail a scripted number of times before they answer. What is retried (unavailable,
overloaded, timeouts, refused connections), what is not (bad input, server errors), how often, and that the
waits are capped and jittered."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
from conftest import PATIENCE_S

from cosyvoice_triton.clients.client import AsyncVCClient, VCClient, VCError
from cosyvoice_triton.clients.retry import NO_RETRY, RetryPolicy, is_retryable

pytest.importorskip("tritonclient.http", reason="pip install 'tritonclient[http,grpc]==2.51.0'")
grpc = pytest.importorskip("grpc")

FAST = RetryPolicy(attempts=4, first_wait=0.01, max_wait=0.05, deadline=30.0)
WAVE = np.linspace(-0.5, 0.5, 8, dtype=np.float32)
SOURCE, PROMPT = np.zeros(16000, np.float32), np.zeros(16000, np.float32)


SLOW = "slow"  # a scripted answer that comes only once the test is over: the client times out
CLIENT_TIMEOUT_S = 5.0  # the client's timeout in the timeout tests: each answer but the SLOW one comes well before


class Script:
    """What the fake server answers to its n-th request: a list of failures, then success."""

    def __init__(self, failures: list):
        self.failures, self.calls, self.lock = list(failures), 0, threading.Lock()
        self.released = threading.Event()  # set at teardown: a SLOW answer stops waiting

    def hold(self) -> None:
        self.released.wait(PATIENCE_S)

    def next(self):
        with self.lock:
            self.calls += 1
            return self.failures.pop(0) if self.failures else None


# ----------------------------------------------------------------------------------------------- HTTP
class FakeHTTP:
    def __init__(self, script: Script):
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                what = outer.script.next()
                if what == SLOW:  # the client times out
                    outer.script.hold()
                    what = None
                if what is None:
                    body = json.dumps({"model_name": "cosyvoice_vc", "outputs": [
                        {"name": "waveform", "datatype": "FP32", "shape": [1, WAVE.size], "data": WAVE.tolist()},
                        {"name": "sample_rate", "datatype": "INT32", "shape": [1, 1], "data": [24000]}]}).encode()
                    code = 200
                else:
                    code, body = what, json.dumps({"error": f"scripted {what}"}).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.script = script
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.script.released.set()
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def fake_http():
    made = []

    def make(failures):
        made.append(FakeHTTP(Script(failures)))
        return made[-1]

    yield make
    for f in made:
        f.close()


def test_http_unavailable_and_overloaded_are_retried_until_served(fake_http):
    srv = fake_http([503, 429, 502])
    with VCClient(srv.url, retry=FAST, timeout=10) as client:
        res = client.convert(SOURCE, PROMPT, source_sr=16000, prompt_sr=16000)
        assert np.array_equal(res.waveform, WAVE) and res.sample_rate == 24000
        assert client.retries == 3
    assert srv.script.calls == 4


@pytest.mark.parametrize("code", [400, 500])
def test_http_bad_input_and_server_errors_are_not_retried(fake_http, code):
    srv = fake_http([code, code])
    with VCClient(srv.url, retry=FAST, timeout=10) as client, pytest.raises(VCError) as err:
        client.convert(SOURCE, PROMPT, source_sr=16000, prompt_sr=16000)
    assert err.value.status == str(code) and client.retries == 0
    assert srv.script.calls == 1


def test_http_gives_up_after_the_policys_attempts(fake_http):
    srv = fake_http([503] * 10)
    with VCClient(srv.url, retry=RetryPolicy(attempts=3, first_wait=0.01, max_wait=0.02), timeout=10) as client, \
            pytest.raises(VCError) as err:
        client.convert(SOURCE, PROMPT, source_sr=16000, prompt_sr=16000)
    assert err.value.status == "503" and "scripted 503" in err.value.message
    assert srv.script.calls == 3 and client.retries == 2


def test_http_timeout_is_retried(fake_http):
    srv = fake_http([SLOW])  # no first answer; the client gives up after its timeout and tries again
    with VCClient(srv.url, retry=FAST, timeout=CLIENT_TIMEOUT_S) as client:
        res = client.convert(SOURCE, PROMPT, source_sr=16000, prompt_sr=16000)
    assert np.array_equal(res.waveform, WAVE) and client.retries == 1 and srv.script.calls == 2


def test_refused_connection_is_retried_within_the_deadline():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once closed
    policy = RetryPolicy(attempts=50, first_wait=0.05, max_wait=0.2, deadline=1.5)
    t0 = time.monotonic()
    with VCClient(f"127.0.0.1:{port}", retry=policy, timeout=5) as client, pytest.raises(VCError):
        client.convert(SOURCE, PROMPT, source_sr=16000, prompt_sr=16000)
    took = time.monotonic() - t0
    assert client.retries >= 3, "a refused connection was not retried"
    assert took < 1.5 + 0.2 + 2.0, f"retries ran {took:.1f} s past a 1.5 s deadline"


def test_no_retry_policy_sends_once(fake_http):
    srv = fake_http([503])
    with VCClient(srv.url, retry=NO_RETRY, timeout=10) as client, pytest.raises(VCError):
        client.convert(SOURCE, PROMPT, source_sr=16000, prompt_sr=16000)
    assert srv.script.calls == 1


def test_convert_many_retries_the_items_that_failed(fake_http):
    srv = fake_http([503, 503])
    with VCClient(srv.url, retry=FAST, timeout=10, concurrency=4) as client:
        out = client.convert_many([{"source": SOURCE, "prompt": PROMPT, "source_sr": 16000, "prompt_sr": 16000}] * 4)
    assert all(not isinstance(r, VCError) for r in out), out
    assert srv.script.calls == 6 and client.retries == 2


def test_async_http_client_retries(fake_http):
    srv = fake_http([503, 429])

    async def go():
        async with AsyncVCClient(srv.url, retry=FAST, timeout=10) as client:
            res = await client.convert(SOURCE, PROMPT, source_sr=16000, prompt_sr=16000)
            return res, client.retries

    res, retries = asyncio.run(go())
    assert np.array_equal(res.waveform, WAVE) and retries == 2 and srv.script.calls == 3


# ----------------------------------------------------------------------------------------------- gRPC
@pytest.fixture
def fake_grpc():
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    servers, scripts = [], []

    def make(failures):
        script = Script(failures)
        scripts.append(script)

        class Service(service_pb2_grpc.GRPCInferenceServiceServicer):
            def ModelInfer(self, request, context):
                what = script.next()
                if what == SLOW:
                    script.hold()
                elif what is not None:
                    context.abort(what, f"scripted {what.name}")
                resp = service_pb2.ModelInferResponse(model_name=request.model_name)
                resp.outputs.add(name="waveform", datatype="FP32", shape=[1, WAVE.size])
                resp.outputs.add(name="sample_rate", datatype="INT32", shape=[1, 1])
                resp.raw_output_contents.extend([WAVE.tobytes(), np.int32(24000).tobytes()])
                return resp

        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(Service(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append(server)
        return f"127.0.0.1:{port}", script

    yield make
    for script in scripts:
        script.released.set()
    for s in servers:
        s.stop(0)


def test_grpc_unavailable_resource_exhausted_and_deadline_are_retried(fake_grpc):
    url, script = fake_grpc([grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED, SLOW])
    with VCClient(url, protocol="grpc", retry=FAST, timeout=CLIENT_TIMEOUT_S) as client:
        res = client.convert(SOURCE, PROMPT, source_sr=16000, prompt_sr=16000)
    assert np.array_equal(res.waveform, WAVE) and res.sample_rate == 24000
    assert script.calls == 4 and client.retries == 3


@pytest.mark.parametrize("code", [grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.INTERNAL])
def test_grpc_invalid_argument_and_internal_are_not_retried(fake_grpc, code):
    url, script = fake_grpc([code])
    with VCClient(url, protocol="grpc", retry=FAST, timeout=10) as client, pytest.raises(VCError) as err:
        client.convert(SOURCE, PROMPT, source_sr=16000, prompt_sr=16000)
    assert err.value.status == str(code) and script.calls == 1


def test_async_grpc_client_retries(fake_grpc):
    url, script = fake_grpc([grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAVAILABLE])

    async def go():
        async with AsyncVCClient(url, protocol="grpc", retry=FAST, timeout=10) as client:
            return await client.convert(SOURCE, PROMPT, source_sr=16000, prompt_sr=16000), client.retries

    res, retries = asyncio.run(go())
    assert np.array_equal(res.waveform, WAVE) and retries == 2 and script.calls == 3


# ----------------------------------------------------------------------------------------------- policy
def test_waits_are_capped_and_jittered():
    import tenacity

    policy = RetryPolicy(attempts=10, first_wait=0.1, max_wait=0.8)
    wait = policy.retrying().wait
    for attempt in (1, 2, 3, 4, 6, 9):
        state = tenacity.RetryCallState(policy.retrying(), fn=None, args=(), kwargs={})
        state.attempt_number = attempt
        draws = [wait(state) for _ in range(200)]
        cap = min(0.8, 0.1 * 2 ** (attempt - 1))
        assert min(draws) >= 0 and max(draws) <= cap + 1e-9, (attempt, max(draws), cap)
        assert np.std(draws) > cap / 10, f"try {attempt}: waits are not jittered ({np.std(draws)})"


def test_what_is_retryable():
    from tritonclient.utils import InferenceServerException

    def triton(status):
        return InferenceServerException("x", status=status)

    assert all(is_retryable(triton(s)) for s in ("503", "429", "502", "504", "StatusCode.UNAVAILABLE",
                                                 "StatusCode.RESOURCE_EXHAUSTED", "StatusCode.DEADLINE_EXCEEDED"))
    assert not any(is_retryable(triton(s)) for s in ("400", "500", "404", "StatusCode.INVALID_ARGUMENT",
                                                     "StatusCode.INTERNAL", "StatusCode.NOT_FOUND"))
    assert is_retryable(ConnectionRefusedError()) and is_retryable(TimeoutError())
    # what a stage killed under load answers (tests/live/test_hardening_live.py): transient, so retried
    assert is_retryable(InferenceServerException("Stub process 'flow_0_0' is not healthy.", status="500"))
    assert is_retryable(InferenceServerException("Request for unknown model: 'cosyvoice_vc' has no available "
                                                 "versions", status="StatusCode.NOT_FOUND"))
    assert is_retryable(InferenceServerException(
        "internal error: BlsError: hift_decoder: Model hift_decoder - Error when running inference: Failed for "
        "execute the inference request. Model 'hift_decoder' is not ready.", status="StatusCode.INTERNAL"))
    assert not is_retryable(InferenceServerException("Request for unknown model: 'x' is not found",
                                                     status="StatusCode.NOT_FOUND"))
    assert not is_retryable(ValueError("bad"))
    wrapped = VCError("wrapped")
    wrapped.__cause__ = ConnectionResetError()
    assert is_retryable(wrapped)
    with pytest.raises(ValueError):
        RetryPolicy(attempts=0)
    with pytest.raises(ValueError):
        RetryPolicy(first_wait=2, max_wait=1)
