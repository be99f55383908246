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


class _HeldUpstream(_SlowUpstream):
    """Triton whose ModelInfer answers once ``answer`` is set; it records whether the call was cancelled."""

    def __init__(self):
        super().__init__()
        self.answer.set()  # the metadata at once
        self.infer_started, self.infer_done, self.infer_cancelled = asyncio.Event(), asyncio.Event(), False
        self.release = asyncio.Event()
        upstream = self

        class Stub:
            async def ModelInfer(self, request, timeout=None, metadata=None):
                upstream.infer_started.set()
                try:
                    await upstream.release.wait()
                except asyncio.CancelledError:
                    upstream.infer_cancelled = True
                    raise
                upstream.infer_done.set()
                return await _Stub().ModelInfer(request)

        self.stub = Stub()


def test_a_client_that_leaves_does_not_cancel_triton_and_keeps_its_slot_until_triton_answers():
    """Triton 2.51's gRPC server can crash when an inference it runs is cancelled (the stress mode crashed it with
    clients whose deadlines passed): the gateway lets the inference finish, the key's slot held until then."""
    async def scene():
        keys, limiter = KeyRing(["ka"]), KeyLimiter(8)
        upstream = _HeldUpstream()
        proxy = KServeProxy(upstream, keys, limiter)
        who = keys.identify("Bearer ka")
        handler = asyncio.ensure_future(proxy.ModelInfer(_request(0), Context("ka")))
        await asyncio.wait_for(upstream.infer_started.wait(), 30)
        handler.cancel()  # the client's deadline passed, or it went away
        await asyncio.gather(handler, return_exceptions=True)
        await asyncio.sleep(0.05)
        assert not upstream.infer_cancelled and limiter.active(who) == 1  # still running at Triton, slot held
        upstream.release.set()
        await asyncio.wait_for(upstream.infer_done.wait(), 30)
        for _ in range(100):
            if limiter.active(who) == 0:
                break
            await asyncio.sleep(0.01)
        assert limiter.active(who) == 0 and not upstream.infer_cancelled

    asyncio.run(scene())
