"""The fair gate (``gateway/fair.py``): when the service is full, a key with a long backlog delays another key's
request by at most one turn; waits are bounded in count and time; a waiter that leaves gives its place (or its
granted slot) on; a live piece of an admitted session does not wait. Through the gRPC proxy too, with a stand-in
Triton that answers the calls it holds one at a time, in the order they reached it."""

from __future__ import annotations

import asyncio

import pytest
from grpc_standin import Context
from test_gateway_grpc import TTS, _request, _Upstream
from tritonclient.grpc import service_pb2

from cosyvoice_triton.gateway.errors import GatewayError
from cosyvoice_triton.gateway.fair import FairGate
from cosyvoice_triton.gateway.kserve_grpc import KServeProxy, admission
from cosyvoice_triton.gateway.limits import KeyLimiter, KeyRing
from cosyvoice_triton.gateway.sessions import Scope, SequenceIds


async def _settle():
    for _ in range(5):
        await asyncio.sleep(0)


def test_a_backlog_delays_another_key_by_one_turn_at_most():
    async def scene():
        gate = FairGate(capacity=2)
        granted: list[str] = []

        async def ask(key, i):
            await gate.acquire(key)
            granted.append(f"{key}{i}")

        tasks = [asyncio.ensure_future(ask("heavy", i)) for i in range(8)]
        await _settle()
        tasks.append(asyncio.ensure_future(ask("light", 0)))
        await _settle()
        assert granted == ["heavy0", "heavy1"] and gate.waiting == 7
        for _ in range(7):
            gate.release()
            await _settle()
        await asyncio.gather(*tasks)
        # first come first served would give the light key the eighth slot; in turn it gets the fourth
        assert granted.index("light0") == 3, granted
        assert gate.in_flight == 2 and gate.waiting == 0

    asyncio.run(scene())


def test_keys_alternate_while_both_wait():
    async def scene():
        gate = FairGate(capacity=1, max_waiting=16)
        granted: list[str] = []

        async def ask(key):
            await gate.acquire(key)
            granted.append(key)

        tasks = [asyncio.ensure_future(ask(k)) for k in ["a"] * 4 + ["b"] * 4]
        await _settle()
        for _ in range(7):
            gate.release()
            await _settle()
        await asyncio.gather(*tasks)
        assert granted == ["a", "a", "b", "a", "b", "a", "b", "b"]

    asyncio.run(scene())


def test_too_many_waiting_is_refused_at_once_and_a_long_wait_is_a_503():
    async def scene():
        gate = FairGate(capacity=1, max_wait_s=0.2, max_waiting=1)
        await gate.acquire("a")
        waiter = asyncio.ensure_future(gate.acquire("b"))
        await _settle()
        with pytest.raises(GatewayError) as refused:
            await gate.acquire("c")
        assert refused.value.status == 503 and refused.value.code == "at_capacity"
        assert "waiting" in refused.value.message
        with pytest.raises(GatewayError) as late:
            await waiter
        assert late.value.status == 503 and "within 0.2 s" in late.value.message
        assert gate.waiting == 0 and gate.in_flight == 1

    asyncio.run(scene())


def test_a_waiter_that_leaves_gives_its_place_or_its_slot_on():
    async def scene():
        gate = FairGate(capacity=1)
        await gate.acquire("a")
        gone = asyncio.ensure_future(gate.acquire("b"))
        stays = asyncio.ensure_future(gate.acquire("c"))
        await _settle()
        gone.cancel()
        await asyncio.gather(gone, return_exceptions=True)
        assert gate.waiting == 1
        gate.release()
        await asyncio.wait_for(stays, 5)
        assert gate.in_flight == 1 and gate.waiting == 0

        # granted in the same turn as it is cancelled: the slot goes on to the next waiter, none is lost
        late = asyncio.ensure_future(gate.acquire("d"))
        after = asyncio.ensure_future(gate.acquire("e"))
        await _settle()
        gate.release()  # grants d's future; d has not run yet
        late.cancel()
        (outcome,) = await asyncio.gather(late, return_exceptions=True)
        if not isinstance(outcome, BaseException):  # asyncio.wait_for may let the grant win over the cancel:
            gate.release()  # then d holds the slot and gives it back as its caller would
        await asyncio.wait_for(after, 5)
        assert gate.in_flight == 1 and gate.waiting == 0

    asyncio.run(scene())


def test_no_capacity_is_no_gate_and_a_continuation_takes_its_slot_at_once():
    async def scene():
        open_gate = FairGate(capacity=0)
        for _ in range(100):
            await open_gate.acquire("a")
        assert open_gate.in_flight == 0
        gate = FairGate(capacity=1)
        await gate.acquire("a")
        gate.take("a")  # beyond the capacity, without waiting
        assert gate.in_flight == 2
        gate.release()
        gate.release()
        assert gate.in_flight == 0

    asyncio.run(scene())


def test_which_requests_continue_a_session():
    def req(model="cosyvoice_vc_live", **params):
        r = service_pb2.ModelInferRequest(model_name=model)
        for name, value in params.items():
            if isinstance(value, bool):
                r.parameters[name].bool_param = value
            elif isinstance(value, int):
                r.parameters[name].int64_param = value
            else:
                r.parameters[name].string_param = value
        return r

    table = SequenceIds()
    mine, other = Scope(table, "t1"), Scope(table, "t2")
    assert not mine.continues(req(sequence_id=7))  # not open yet: a continuation only of what was admitted
    table.upstream("t1", "cosyvoice_vc_live", 7, start=True)
    table.upstream("t1", "cosyvoice_vc_live", "s-1", start=True)
    assert not mine.continues(req())
    assert not mine.continues(req(sequence_id=7, sequence_start=True))
    assert mine.continues(req(sequence_id=7))
    assert mine.continues(req(sequence_id="s-1", sequence_end=True))
    assert not mine.continues(req(sequence_id="7")) and not mine.continues(req(sequence_id=0))
    assert not other.continues(req(sequence_id=7))  # another tenant's id is not its session
    assert not mine.continues(req("cosyvoice_tts_live", sequence_id=7))
    assert not Scope(None, None).continues(req(sequence_id=7))
    assert admission(mine, req(sequence_id=7)) == (False, False)  # an open session's piece: no wait, not counted
    assert admission(mine, req(sequence_id=8)) == (True, True)  # an id the tenant has not opened: new work
    open_gate = Scope(None, None)  # no tenants: a piece known by its shape does not wait, and counts
    assert admission(open_gate, req(sequence_id=7)) == (False, True)
    assert admission(open_gate, req(sequence_id=7, sequence_start=True)) == (True, True)
    assert admission(open_gate, req()) == (True, True)


def test_a_piece_of_an_admitted_session_is_not_refused_by_its_keys_limit():
    """The long stress run's finding: a key's live session (its pieces in flight at once) beside the key's other
    requests passed the key's concurrency, and the session's later pieces were refused, cutting it halfway."""
    async def scene():
        keys = KeyRing(["ka"], {"ka": "tenant_a"})
        limiter = KeyLimiter(1, rate="2/minute", gate=FairGate(capacity=8))
        upstream = _OneAtATime()
        proxy = KServeProxy(upstream, keys, limiter, SequenceIds())

        def piece(i: int, **flags):
            r = _request(i)
            r.parameters["sequence_id"].int64_param = 41
            for name, value in flags.items():
                r.parameters[name].bool_param = value
            return r

        start = asyncio.ensure_future(proxy.ModelInfer(piece(0, sequence_start=True), Context("ka")))
        await _until(lambda: len(upstream.started) == 1)
        more = [asyncio.ensure_future(proxy.ModelInfer(piece(i), Context("ka"))) for i in (1, 2)]
        await _until(lambda: len(upstream.started) == 3)  # beyond the key's 1 and its rate of 2: still admitted
        who = keys.identify("Bearer ka")
        assert limiter.active(who) == 1 and limiter.gate.in_flight == 3  # the session counts once, at its start
        context = Context("ka")  # new work of the key is still refused at its limit
        with pytest.raises(RuntimeError, match="aborted"):
            await proxy.ModelInfer(_request(9), context)
        assert "too many concurrent requests" in context.aborted[1]
        while upstream.waiting:
            upstream.answer_next()
        await asyncio.wait_for(asyncio.gather(start, *more), 30)
        assert limiter.active(who) == 0 and limiter.gate.in_flight == 0

    asyncio.run(scene())


async def _until(condition, ceiling_s: float = 60.0):
    loop = asyncio.get_running_loop()
    end = loop.time() + ceiling_s
    while not condition():
        assert loop.time() < end, "the condition never held"
        await asyncio.sleep(0.005)


class _OneAtATime(_Upstream):
    """Triton holding every ModelInfer until :meth:`answer_next` answers the oldest; it records their ids."""

    def __init__(self):
        super().__init__()
        self.started: list[str] = []
        self.waiting: list[asyncio.Event] = []
        self.arrived = asyncio.Event()
        upstream = self

        class Stub:
            async def ModelInfer(self, request, timeout=None, metadata=None):
                done = asyncio.Event()
                upstream.started.append(request.id)
                upstream.waiting.append(done)
                upstream.arrived.set()
                await done.wait()
                return service_pb2.ModelInferResponse(model_name=request.model_name, id=request.id)

        self.stub = Stub()

    def answer_next(self):
        self.waiting.pop(0).set()


def test_through_the_proxy_the_light_key_is_answered_in_its_turn():
    async def scene():
        keys = KeyRing(["heavy", "light"])
        limiter = KeyLimiter(8, gate=FairGate(capacity=2))
        upstream = _OneAtATime()
        proxy = KServeProxy(upstream, keys, limiter)
        calls = []
        for i in range(6):
            req = _request(i)
            req.id = f"heavy{i}"
            calls.append(asyncio.ensure_future(proxy.ModelInfer(req, Context("heavy"))))
            await _settle()
        light = _request(0)
        light.id = "light"
        calls.append(asyncio.ensure_future(proxy.ModelInfer(light, Context("light"))))
        await _until(lambda: len(upstream.started) == 2 and limiter.gate.waiting == 5)
        assert set(upstream.started) == {"heavy0", "heavy1"}
        for n in range(3, 8):  # each answer lets the next request in; it reaches Triton after its check (a thread)
            upstream.answer_next()
            await _until(lambda n=n: len(upstream.started) == n)
        assert upstream.started.index("light") == 3, upstream.started  # first come first served: 6
        while upstream.waiting:
            upstream.answer_next()
        answers = await asyncio.wait_for(asyncio.gather(*calls), 30)
        assert [a.id for a in answers] == [*(f"heavy{i}" for i in range(6)), "light"]
        assert limiter.gate.in_flight == 0 and limiter.active(keys.identify("Bearer heavy")) == 0

    asyncio.run(scene())


def test_metadata_calls_do_not_wait_at_the_gate():
    async def scene():
        limiter = KeyLimiter(8, gate=FairGate(capacity=1, max_wait_s=0.1))
        proxy = KServeProxy(_Upstream(), KeyRing(["ka"]), limiter)
        await limiter.gate.acquire("someone")  # full
        metadata = service_pb2.ModelMetadataRequest(name=TTS)
        stub = proxy.upstream.stub

        async def model_metadata(request, timeout=None, metadata=None):
            return service_pb2.ModelMetadataResponse(name=request.name)

        stub.ModelMetadata = model_metadata
        answer = await proxy.ModelMetadata(metadata, Context("ka"))
        assert answer.name == TTS
        context = Context("ka")
        with pytest.raises(RuntimeError, match="aborted"):
            await proxy.ModelInfer(_request(0), context)
        assert "capacity" in context.aborted[1]

    asyncio.run(scene())
