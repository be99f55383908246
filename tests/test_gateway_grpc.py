"""The gateway's KServe gRPC server in process, on a free port, in front of a stand-in Triton: what grpc's own
server does with bytes that are not the method's message, and the per-key limits on a stream's requests."""

from __future__ import annotations

import asyncio
import socket

import grpc
import pytest
from tritonclient.grpc import service_pb2

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
                async for req in requests:
                    stub.received += 1
                    stub.held += 1
                    stub.most = max(stub.most, stub.held)
                    pending.append(req)
                    if len(pending) < 30 and not stub.release.is_set():
                        continue
                    await stub.release.wait()
                    for r in pending:
                        stub.held -= 1
                        answer = service_pb2.ModelStreamInferResponse(
                            infer_response=service_pb2.ModelInferResponse(model_name=r.model_name, id=r.id))
                        answer.infer_response.parameters["triton_final_response"].bool_param = True
                        yield answer
                    pending = []

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
                         f"127.0.0.1:{port}", 1 << 20)
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
