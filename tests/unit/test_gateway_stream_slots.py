"""A key's concurrency slots come back when a gRPC stream ends in any way: found by the load tests' stress mode
(``--mode stress``: hostile clients that cancel their streams), where a stream cancelled while one of its requests
was being checked kept that request's slot for good, until the key got nothing but 429 / RESOURCE_EXHAUSTED."""

from __future__ import annotations

import asyncio

from grpc_standin import Context
from test_gateway_grpc import TTS, _request, _Stub

from cosyvoice_triton.gateway.inference import Signature
from cosyvoice_triton.gateway.kserve_grpc import KServeProxy
from cosyvoice_triton.gateway.limits import KeyLimiter, KeyRing

SIG = Signature.from_metadata({"name": TTS, "inputs": [{"name": "text", "datatype": "BYTES", "shape": ["-1", "1"]}],
                               "outputs": [{"name": "waveform", "datatype": "FP32", "shape": ["-1", "-1"]}]})


class _SlowUpstream:
    """Triton whose model metadata (read while a request is checked) come only once ``answer`` is set."""

    models, timeout_s = frozenset({TTS}), 30.0

    def __init__(self):
        self.stub, self.asked, self.answer = _Stub(), asyncio.Event(), asyncio.Event()

    def public(self, model):
        return model

    async def signature(self, model):
        self.asked.set()
        await self.answer.wait()
        return SIG


def test_a_stream_cancelled_while_a_request_is_checked_gives_its_slot_back():
    async def scene():
        keys, limiter = KeyRing(["ka"]), KeyLimiter(8)
        upstream = _SlowUpstream()
        proxy = KServeProxy(upstream, keys, limiter)
        who = keys.identify("Bearer ka")

        async def requests():
            yield _request(0)
            await asyncio.Event().wait()  # the client keeps its side open

        stream = proxy.ModelStreamInfer(requests(), Context("ka"))
        reader = asyncio.ensure_future(stream.__anext__())
        await asyncio.wait_for(upstream.asked.wait(), 30)
        assert limiter.active(who) == 1  # taken for the request being checked
        reader.cancel()  # the client cancels: gRPC cancels the handler
        await asyncio.gather(reader, return_exceptions=True)
        await stream.aclose()
        for _ in range(100):  # the stream's tasks end on their next turns
            if limiter.active(who) == 0:
                break
            await asyncio.sleep(0.01)
        assert limiter.active(who) == 0

    asyncio.run(scene())
