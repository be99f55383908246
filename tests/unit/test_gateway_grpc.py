"""The gateway's KServe gRPC server in process, on a free port, in front of a stand-in Triton: what grpc's own
server does with bytes that are not the method's message, and the per-key limits on a stream's requests."""

from __future__ import annotations

import asyncio
import socket

import grpc
import pytest
from grpc_standin import Context, stream_through
from tritonclient.grpc import service_pb2

from cosyvoice_triton.gateway import GatewayConfig
from cosyvoice_triton.gateway.inference import Signature
from cosyvoice_triton.gateway.kserve_grpc import KServeProxy, make_server
from cosyvoice_triton.gateway.limits import KeyLimiter, KeyRing

TTS = "cosyvoice_tts"
SIG = Signature.from_metadata({"name": TTS, "inputs": [{"name": "text", "datatype": "BYTES", "shape": ["-1", "1"]}],
                               "outputs": [{"name": "waveform", "datatype": "FP32", "shape": ["-1", "-1"]}]})
SERVICE = "/inference.GRPCInferenceService/"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Stub:
    """Triton, as far as these tests go: ``ModelInfer`` answers, ``ModelStreamInfer`` answers each request once
    ``release`` is set (decoupled: its responses, then a final flag), counting how many it holds at a time."""

    def __init__(self):
        self.release = asyncio.Event()
        self.held = self.most = 0
        self.received = 0

    async def ModelInfer(self, request, timeout=None, metadata=None):
        return service_pb2.ModelInferResponse(model_name=request.model_name, id=request.id)

    def ModelStreamInfer(self, requests, metadata=None):
        stub = self

        class Call:
            def cancel(self):
                pass

            async def __aiter__(self):
                pending = []
                requests_left = requests.__aiter__()
                while True:
                    try:
                        req = await requests_left.__anext__()
                    except StopAsyncIteration:
                        req = None
                    if req is not None:
                        stub.received += 1
                        stub.held += 1
                        stub.most = max(stub.most, stub.held)
                        pending.append(req)
                        if not stub.release.is_set():
                            continue
                    if not pending:
                        return
                    await stub.release.wait()  # the client's half-close does not end the requests at Triton
                    for r in pending:
                        stub.held -= 1
                        answer = service_pb2.ModelStreamInferResponse(
                            infer_response=service_pb2.ModelInferResponse(model_name=r.model_name, id=r.id))
                        answer.infer_response.outputs.add(name="waveform", datatype="FP32", shape=[1, 0])
                        answer.infer_response.parameters["triton_final_response"].bool_param = False
                        yield answer
                        asked = r.parameters.get("triton_enable_empty_final_response")
                        if asked is not None and asked.bool_param:  # Triton sends the final flag only when asked
                            final = service_pb2.ModelStreamInferResponse(
                                infer_response=service_pb2.ModelInferResponse(model_name=r.model_name, id=r.id))
                            final.infer_response.parameters["triton_final_response"].bool_param = True
                            yield final
                    pending = []
                    if req is None:
                        return

        return Call()


class _Upstream:
    models, timeout_s = frozenset({TTS}), 30.0

    def __init__(self):
        self.stub = _Stub()

    def public(self, model):
        return model

    async def signature(self, model):
        return SIG


def _request(i: int = 0) -> service_pb2.ModelInferRequest:
    req = service_pb2.ModelInferRequest(model_name=TTS, id=f"r{i}")
    req.inputs.add(name="text", datatype="BYTES", shape=[1, 1]).contents.bytes_contents.append(b"Hello.")
    return req


async def _serve(limiter: KeyLimiter | None = None, keys=("ka", "kb")):
    upstream = _Upstream()
    port = _port()
    server = make_server(KServeProxy(upstream, KeyRing(list(keys)), limiter or KeyLimiter()),
                         f"127.0.0.1:{port}", GatewayConfig(max_body_bytes=1 << 20))
    await server.start()
    return server, upstream, grpc.aio.insecure_channel(f"127.0.0.1:{port}")


GARBAGE = [b"\xff\xff\xff\xff", b"\x0a\x80", b"\x0a\x05ab"]


@pytest.mark.parametrize("garbage", GARBAGE)
def test_garbage_protobuf_is_invalid_argument(garbage):
    async def scene():
        server, _, channel = await _serve()
        try:
            auth = (("authorization", "Bearer ka"),)
            infer = channel.unary_unary(SERVICE + "ModelInfer")  # no serializer: the bytes go as they are
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await infer(garbage, metadata=auth, timeout=10)
            assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT, exc.value
            assert "ModelInferRequest" in exc.value.details()
            meta = channel.unary_unary(SERVICE + "ModelMetadata")
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await meta(garbage, metadata=auth, timeout=10)
            assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT, exc.value
            stream = channel.stream_stream(SERVICE + "ModelStreamInfer")
            call = stream(iter([garbage]), metadata=auth, timeout=10)
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                async for _ in call:
                    pass
            assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT, exc.value
            config = channel.unary_unary(SERVICE + "ModelConfig")  # Triton keeps it behind its admin key
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await config(b"", metadata=auth, timeout=10)
            assert exc.value.code() == grpc.StatusCode.UNIMPLEMENTED, exc.value
            # a good request still works on the same server
            good = channel.unary_unary(SERVICE + "ModelInfer", request_serializer=service_pb2.ModelInferRequest.
                                       SerializeToString,
                                       response_deserializer=service_pb2.ModelInferResponse.FromString)
            assert (await good(_request(), metadata=auth, timeout=10)).id == "r0"
        finally:
            await channel.close()
            await server.stop(None)

    asyncio.run(scene())


@pytest.mark.parametrize("codes", [False, True])
def test_each_request_of_a_stream_counts_against_the_keys_concurrency(codes):
    """Thirty requests on one stream with a limit of 8: eight go on, the rest are refused naming the limit (or the
    stream ends with RESOURCE_EXHAUSTED); another key still gets through; the slots come back with the final
    responses, which the client that did not ask for them never sees."""
    from cosyvoice_triton.gateway.kserve_grpc import KServeProxy as Proxy

    limiter = KeyLimiter(8)
    upstream = _Upstream()
    keys = KeyRing(["ka", "kb"])
    proxy = Proxy(upstream, keys, limiter)
    a_id, b_id = keys.identify("Bearer ka"), keys.identify("Bearer kb")

    async def collect(key, n, ctx_codes, answers):
        async def requests():
            for i in range(n):
                yield _request(i)
        try:
            async for a in proxy.ModelStreamInfer(requests(), ctx := Context(key, ctx_codes)):
                answers.append(a)
        except RuntimeError:
            pass
        return ctx

    async def until(cond, what):
        for _ in range(500):
            if cond():
                return
            await asyncio.sleep(0.01)
        raise AssertionError(what)

    async def scene():
        a_answers, b_answers = [], []
        a = asyncio.ensure_future(collect("ka", 30, codes, a_answers))
        await until(lambda: upstream.stub.received == 8, "eight of A's requests at Triton")
        if codes:
            ctx = await a
            assert ctx.aborted[0] == grpc.StatusCode.RESOURCE_EXHAUSTED and "at most 8" in ctx.aborted[1]
        else:
            await until(lambda: len(a_answers) == 22, "22 of A's requests refused in the stream")
            assert all("at most 8" in x.error_message for x in a_answers)
            assert limiter.active(a_id) == 8
        b = asyncio.ensure_future(collect("kb", 1, codes, b_answers))
        await until(lambda: upstream.stub.received == 9, "B's request at Triton while A holds its 8")
        assert limiter.active(b_id) == 1
        upstream.stub.release.set()
        await b
        assert len(b_answers) == 1 and not b_answers[0].error_message and b_answers[0].infer_response.outputs
        if not codes:
            await a
            data = [x for x in a_answers if not x.error_message]
            assert len(data) == 8 and all(x.infer_response.outputs for x in data)  # no empty finals
        assert upstream.stub.received == 9
        assert limiter.active(a_id) == 0 and limiter.active(b_id) == 0
        again: list = []
        await collect("ka", 8, codes, again)  # the slots came back
        assert len(again) == 8 and not any(x.error_message for x in again)
        assert limiter.active(a_id) == 0

    asyncio.run(scene())


def test_live_sessions_per_tenant_and_model_leave_room_for_another_key():
    """A tenant holds at most its share of a live model's sessions (by default half the model's own
    ``live_*_max_sessions``): key A's next start is refused naming the limit, key B still opens one."""
    from cosyvoice_triton.gateway.config import GatewayConfig, from_args
    from cosyvoice_triton.gateway.errors import GatewayError
    from cosyvoice_triton.gateway.sessions import SequenceIds

    defaults = dict(GatewayConfig().live_sessions_per_tenant)
    assert defaults == {"cosyvoice_vc_live": 2, "cosyvoice_tts_live": 1, "cosyvoice3_tts_live": 1,
                        "cosyvoice3_vc_live": 2}
    assert dict(from_args(["--live-sessions-per-tenant", "cosyvoice_tts_live=3"]).live_sessions_per_tenant) == \
        {"cosyvoice_vc_live": 2, "cosyvoice_tts_live": 3, "cosyvoice3_tts_live": 1, "cosyvoice3_vc_live": 2}
    table = SequenceIds(1024, 64, 35.0, per_model=defaults)
    for sid in (1, 2):
        table.upstream("a", "cosyvoice_vc_live", sid, start=True)
    with pytest.raises(GatewayError) as exc:
        table.upstream("a", "cosyvoice_vc_live", 3, start=True)
    assert exc.value.status == 429 and "at most 2" in exc.value.message and "cosyvoice_vc_live" in exc.value.message
    table.upstream("a", "cosyvoice_vc_live", 1, start=True)  # a start on its own open id is that session
    table.upstream("b", "cosyvoice_vc_live", 1, start=True)  # another tenant still gets one
    table.upstream("a", "cosyvoice_tts_live", 1, start=True)  # another model has its own share
    with pytest.raises(GatewayError, match="at most 1"):
        table.upstream("a", "cosyvoice_tts_live", 2, start=True)
    table.upstream("a", "cosyvoice_vc_live", 2, end=True)  # an end frees the share
    table.upstream("a", "cosyvoice_vc_live", 3, start=True)
    table.upstream("a", "cosyvoice_tts", 9, start=True)  # a model without a share: the tenant's bound only


def test_a_stream_refuses_a_start_beyond_the_tenants_share():
    from cosyvoice_triton.gateway.kserve_grpc import KServeProxy as Proxy
    from cosyvoice_triton.gateway.sessions import SequenceIds

    live = "cosyvoice_vc_live"
    upstream = _Upstream()
    upstream.models = frozenset({live})
    upstream.stub.release.set()
    proxy = Proxy(upstream, KeyRing(["ka", "kb"]), KeyLimiter(8), SequenceIds(1024, 64, 35.0, per_model={live: 1}))

    def start(sid):
        req = _request(sid)
        req.model_name = live
        req.parameters["sequence_id"].int64_param = sid
        req.parameters["sequence_start"].bool_param = True
        return req

    async def scene():
        a = await stream_through(proxy, "ka", [start(1), start(2)])
        assert not a[0].error_message and "at most 1" in a[1].error_message and live in a[1].error_message
        b = await stream_through(proxy, "kb", [start(1)])
        assert not b[0].error_message

    asyncio.run(scene())
