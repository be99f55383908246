"""Sequence ids per tenant at the KServe entry points, in process (no server): the table of
:mod:`cosyvoice_triton.gateway.sessions` (each tenant's ids apart, starts, ends, unknown ids, idle expiry, the
bounds), the answers given back in the client's ids (gRPC and HTTP), the HTTP body's and the gRPC stream's wiring
(a stand-in Triton that answers as Triton does). Against a real Triton, both live models and both tenants:
``test_gateway_sessions_live.py``."""

from __future__ import annotations

import asyncio
import json
import re

import pytest
from grpc_standin import stream_through

from cosyvoice_triton.gateway.errors import GatewayError
from cosyvoice_triton.gateway.inference import Signature
from cosyvoice_triton.gateway.kserve_http import checked_body
from cosyvoice_triton.gateway.sessions import Names, Scope, SequenceIds
from cosyvoice_triton.gateway.tenants import Namespace

VC = "cosyvoice_vc_live"
TTS = "cosyvoice_tts_live"


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def _table(**kw):
    clock = Clock()
    return SequenceIds(**{"max_open": 8, "max_per_tenant": 4, "idle_s": 35.0, **kw}, clock=clock), clock


def _drawn_int(x) -> bool:
    return isinstance(x, int) and 2**32 <= x < 2**63


def test_each_tenant_has_its_own_sequence_on_the_same_id():
    t, _ = _table()
    for client in (7, "talk"):
        b = t.upstream("b", VC, client, start=True)
        assert b != client and (_drawn_int(b) if client == 7 else re.fullmatch(r"gw[0-9a-f]{32}", b))
        assert t.upstream("b", VC, client) == b  # B's next piece: B's sequence
        assert t.upstream("a", VC, client) not in (b, client)  # A's piece without a start: not B's
        assert t.upstream("a", VC, client, end=True) != b  # A's end ends nothing of B's
        assert t.open_count("b") == 1 and t.open_count("a") == 0
        a = t.upstream("a", VC, client, start=True)  # A's start opens A's own
        assert a not in (b, client) and t.open_count("a") == 1 and t.open_count("b") == 1
        assert t.upstream("b", VC, client, end=True) == b and t.upstream("a", VC, client, end=True) == a
    assert t.open_count() == 0


def test_a_start_on_an_open_id_is_the_same_sequence_and_the_end_closes_it():
    t, _ = _table()
    first = t.upstream("a", TTS, 5, start=True)
    assert t.upstream("a", TTS, 5, start=True) == first  # Triton answers "already live", as without the gateway
    assert t.open_count() == 1
    assert t.upstream("a", TTS, 5, end=True) == first
    assert t.open_count() == 0 and t.closed_count() == 1
    assert t.upstream("a", TTS, 5) == first  # a late piece: Triton's own answer for the ended sequence
    assert t.upstream("a", TTS, 5, start=True, end=True) == first  # a one-piece session reopens and ends it
    assert t.open_count() == 0


def test_an_id_nobody_opened_gets_a_fresh_id_never_kept():
    t, _ = _table()
    drawn = {t.upstream("a", VC, 9) for _ in range(20)}
    assert len(drawn) == 20 and all(map(_drawn_int, drawn))
    assert t.open_count() == 0 and t.closed_count() == 0
    assert re.fullmatch(r"gw[0-9a-f]{32}", t.upstream("a", VC, "s"))


def test_ids_are_apart_by_kind_and_by_model():
    t, _ = _table()
    ids = {t.upstream("a", VC, 5, start=True), t.upstream("a", VC, "5", start=True),
           t.upstream("a", TTS, 5, start=True)}
    assert len(ids) == 3 and t.open_count("a") == 3
    assert t.upstream("a", VC, 5, end=True) in ids and t.open_count("a") == 2


def test_idle_ids_are_forgotten_and_activity_keeps_them():
    t, clock = _table(idle_s=10.0)
    kept = t.upstream("a", VC, 1, start=True)
    gone = t.upstream("a", VC, 2, start=True)
    t.upstream("a", VC, 3, start=True, end=True)  # closed
    clock.now += 6
    assert t.upstream("a", VC, 1) == kept
    clock.now += 6  # 2 and the closed 3: idle for 12 s; 1 for 6 s
    assert t.open_count() == 1 and t.closed_count() == 0
    assert t.upstream("a", VC, 1) == kept
    assert t.upstream("a", VC, 2) != gone  # forgotten: an unknown id now
    assert t.upstream("a", VC, 2, start=True) != gone


def test_the_bounds_refuse_a_start_clearly_and_free_on_end():
    t, _ = _table(max_open=5, max_per_tenant=3)
    for i in range(3):
        t.upstream("a", VC, i, start=True)
    with pytest.raises(GatewayError) as exc:
        t.upstream("a", VC, 99, start=True)
    assert exc.value.status == 429 and exc.value.code == "too_many_sequences" and "at most 3" in exc.value.message
    t.upstream("a", VC, 0)  # pieces of its open ones and unknown ids still go
    t.upstream("a", VC, 1234)
    for i in range(2):
        t.upstream("b", VC, i, start=True)  # another tenant is not held back by A's
    with pytest.raises(GatewayError) as exc:
        t.upstream("c", VC, 0, start=True)
    assert exc.value.status == 429 and "5 open sequences" in exc.value.message
    t.upstream("a", VC, 0, end=True)
    t.upstream("c", VC, 0, start=True)
    assert t.open_count() == 5 and t.open_count("a") == 2 and t.open_count("c") == 1


def test_closed_ids_are_remembered_within_a_bound():
    t, _ = _table(max_open=3, max_per_tenant=3)
    first = t.upstream("a", VC, 0, start=True, end=True)
    for i in range(1, 6):
        t.upstream("a", VC, i, start=True, end=True)
    assert t.closed_count() == 3 and t.open_count() == 0
    assert t.upstream("a", VC, 0) != first  # the oldest closed one is forgotten


def test_bad_bounds_are_refused():
    for kw in ({"max_open": 0}, {"max_per_tenant": 0}, {"idle_s": 0.0}):
        with pytest.raises(ValueError):
            SequenceIds(**kw)


def test_names_give_the_clients_id_back_in_messages():
    names = Names(kept=2)
    names.add(4294967301, 17)
    names.add("gw" + "a" * 32, "talk")
    msg = ("inference request for sequence 4294967301 to model 'm' must specify the START flag; "
           f"session 'gw{'a' * 32}' is already live; 42949673010 and 4294967302 are someone else's")
    assert names.text(msg) == ("inference request for sequence 17 to model 'm' must specify the START flag; "
                               "session 'talk' is already live; 42949673010 and 4294967302 are someone else's")
    names.add(4294967302, 18)  # kept: 2, the oldest forgotten
    assert names.text("4294967301 4294967302") == "4294967301 18"


def test_without_keys_ids_pass_through():
    scope = Scope(None, None)
    params = {"sequence_id": 5, "sequence_start": True}
    assert scope.json_parameters(VC, params) == params and not scope.names
    assert scope.http_answer(b'{"parameters":{"sequence_id":5}}', None) == (b'{"parameters":{"sequence_id":5}}', None)


def test_json_parameters_and_the_http_answer():
    t, _ = _table()
    scope = Scope(t, "a")
    assert scope.json_parameters(VC, {"priority": 1}) == {"priority": 1}
    assert scope.json_parameters(VC, {"sequence_id": 0})["sequence_id"] == 0  # no sequence
    sent = scope.json_parameters(VC, {"sequence_id": 12, "sequence_start": True})
    drawn = sent["sequence_id"]
    assert _drawn_int(drawn) and sent["sequence_start"] is True and t.open_count("a") == 1
    body = json.dumps({"model_name": VC, "parameters": {"sequence_id": drawn, "sequence_end": False},
                       "outputs": [{"name": "waveform", "parameters": {"binary_data_size": 4}}]}).encode()
    out, length = scope.http_answer(body + b"\x00\x01\x02\x03", str(len(body)))
    head = json.loads(out[: int(length)])
    assert head["parameters"]["sequence_id"] == 12 and out[int(length):] == b"\x00\x01\x02\x03"
    error = json.dumps({"error": f"inference request for sequence {drawn} to model 'x' must ..."}).encode()
    assert json.loads(scope.http_answer(error, None)[0]) == {"error": "inference request for sequence 12 to "
                                                                      "model 'x' must ..."}


def test_checked_body_maps_the_id_only_for_a_request_that_passes():
    sig = Signature.from_metadata({"name": VC, "inputs": [{"name": "source_audio", "datatype": "FP32",
                                                           "shape": ["-1", "-1"]}], "outputs": []})
    t, _ = _table()
    good = {"parameters": {"sequence_id": "s", "sequence_start": True},
            "inputs": [{"name": "source_audio", "shape": [1, 2], "datatype": "FP32", "data": [0.0, 0.5]}]}
    bad = {**good, "inputs": [{**good["inputs"][0], "shape": [1, 3]}]}
    with pytest.raises(GatewayError):
        checked_body(sig, json.dumps(bad).encode(), None, Namespace("a"), 16, Scope(t, "a"))
    assert t.open_count() == 0
    sent = json.loads(checked_body(sig, json.dumps(good).encode(), None, Namespace("a"), 16, Scope(t, "a"))[0])
    assert sent["parameters"]["sequence_id"].startswith("gw") and t.open_count("a") == 1


def _grpc_piece(sequence_id, start=False, end=False, model=VC):
    from tritonclient.grpc import service_pb2

    req = service_pb2.ModelInferRequest(model_name=model, id="r")
    req.inputs.add(name="source_audio", datatype="FP32", shape=[1, 2])
    req.raw_input_contents.append(b"\x00" * 8)
    if isinstance(sequence_id, str):
        req.parameters["sequence_id"].string_param = sequence_id
    else:
        req.parameters["sequence_id"].int64_param = sequence_id
    req.parameters["sequence_start"].bool_param = start
    req.parameters["sequence_end"].bool_param = end
    return req


def test_grpc_request_and_answers():
    from tritonclient.grpc import service_pb2

    t, _ = _table()
    for client in (31, "talk"):
        scope = Scope(t, "a")
        req = _grpc_piece(client, start=True)
        scope.grpc_request(req)
        which = req.parameters["sequence_id"].WhichOneof("parameter_choice")
        drawn = getattr(req.parameters["sequence_id"], which)
        assert which == ("string_param" if isinstance(client, str) else "int64_param") and drawn != client
        response = service_pb2.ModelInferResponse(model_name=VC)
        if isinstance(drawn, str):
            response.parameters["sequence_id"].string_param = drawn
        else:
            response.parameters["sequence_id"].int64_param = drawn
        back = scope.grpc_response(response)
        assert getattr(back.parameters["sequence_id"], which) == client
        answer = service_pb2.ModelStreamInferResponse(error_message=f"session {drawn!r} is already live",
                                                      infer_response=response)
        back = scope.grpc_stream_answer(answer)
        assert back.error_message == f"session {client!r} is already live"
        assert getattr(back.infer_response.parameters["sequence_id"], which) == client
        plain = service_pb2.ModelStreamInferResponse(infer_response=service_pb2.ModelInferResponse(id="x"))
        assert scope.grpc_stream_answer(plain) is plain
    none = _grpc_piece(0)
    Scope(t, "a").grpc_request(none)
    assert none.parameters["sequence_id"].int64_param == 0


# ------------------------------------------------------------------------ the gRPC stream, stand-in Triton
class _Triton:
    """Triton's sequence batcher, as far as ids go: a start opens the id, a piece of an id never started is refused
    naming it, the end closes it; each request answered by one response (the id it was given as its id)."""

    def __init__(self):
        self.live, self.seen = set(), []

    def ModelStreamInfer(self, requests, metadata=None):
        from tritonclient.grpc import service_pb2

        triton = self

        class Call:
            def cancel(self):
                pass

            async def __aiter__(self):
                async for req in requests:
                    p = req.parameters["sequence_id"]
                    sid = getattr(p, p.WhichOneof("parameter_choice"))
                    triton.seen.append(sid)
                    if req.parameters["sequence_start"].bool_param:
                        triton.live.add(sid)
                    elif sid not in triton.live:
                        yield service_pb2.ModelStreamInferResponse(
                            error_message=f"inference request for sequence {sid} to model '{req.model_name}' "
                                          "must specify the START flag on the first request of the sequence")
                        continue
                    if req.parameters["sequence_end"].bool_param:
                        triton.live.discard(sid)
                    yield service_pb2.ModelStreamInferResponse(
                        infer_response=service_pb2.ModelInferResponse(model_name=req.model_name, id=str(sid)))

        return Call()


def test_the_grpc_stream_maps_each_tenants_ids_and_answers_in_theirs():
    from cosyvoice_triton.gateway.kserve_grpc import KServeProxy
    from cosyvoice_triton.gateway.limits import KeyLimiter, KeyRing

    sig = Signature.from_metadata({"name": VC, "inputs": [{"name": "source_audio", "datatype": "FP32",
                                                           "shape": ["-1", "-1"]}], "outputs": []})

    class Upstream:
        models, timeout_s, stub = frozenset({VC}), 30.0, _Triton()

        def public(self, model):
            return model

        async def signature(self, model):
            return sig

    upstream, table = Upstream(), SequenceIds(8, 4, 35.0)
    proxy = KServeProxy(upstream, KeyRing(["ka", "kb"], {"ka": "a", "kb": "b"}), KeyLimiter(), table)

    async def scene():
        b = await stream_through(proxy, "kb", [_grpc_piece(7, start=True)])
        assert not b[0].error_message and table.open_count("b") == 1
        a = await stream_through(proxy, "ka", [_grpc_piece(7), _grpc_piece(7, end=True), _grpc_piece(7, start=True),
                                               _grpc_piece(7, end=True)])
        unknown = "inference request for sequence 7 to model 'cosyvoice_vc_live' must specify the START flag"
        assert [x.error_message[: len(unknown)] for x in a[:2]] == [unknown, unknown]
        assert not a[2].error_message and not a[3].error_message
        assert table.open_count("b") == 1 and table.open_count("a") == 0
        b = await stream_through(proxy, "kb", [_grpc_piece(7, end=True)])
        assert not b[0].error_message and table.open_count() == 0 and not upstream.stub.live
        assert 7 not in upstream.stub.seen and len(set(upstream.stub.seen)) == 4  # B's, A's two unknown, A's own

    asyncio.run(scene())


def test_the_flags_and_the_gauge():
    from cosyvoice_triton.gateway import GatewayConfig, create_app
    from cosyvoice_triton.gateway.config import from_args

    c = from_args(["--max-sequences", "10", "--max-sequences-per-tenant", "2", "--sequence-idle-s", "5"])
    assert (c.max_sequences, c.max_sequences_per_tenant, c.sequence_idle_s) == (10, 2, 5.0)
    app = create_app(GatewayConfig(api_keys=frozenset({"k"})), backend=object())
    assert b"cosyvoice_gateway_sequences 0.0" in app.state.metrics.render()
