"""The served live models over gRPC (one bidirectional stream per session, Triton's sequence batcher): a source
streamed in real-time-sized pieces is converted as it arrives and equals the library for the same pieces; bad
input and faults each get a clear error while the server and the other streams go on; state is freed when a
stream ends, its client vanishes or it goes idle (the ``cosyvoice_live_sessions`` gauge). The session machinery
(``serving.stages.live.LiveSessions``) is first tested in process with a stand-in ``pb``."""

from __future__ import annotations

import queue
import threading
import time
import types
import urllib.request

import numpy as np
import pb_standin
import pytest
from conftest import PATIENCE_S, rel_err, served, speech_pair, wait_until

from cosyvoice_triton.errors import CosyVoiceError
from cosyvoice_triton.serving.stages.live import LiveSessions
from cosyvoice_triton.serving.stages.live_vc import LIVE_VC_MODEL, LiveSettings, LiveVC, convert_pieces

SEED = 5
IDLE_S = 4.0
MAX_SESSIONS = 2
MAX_QUEUED = 3


# ------------------------------------------------------------------------------ LiveSessions in process (stand-in pb)
class _Err(pb_standin.Err):
    INVALID_ARG, INTERNAL, UNAVAILABLE, CANCELLED = "INVALID_ARG", "INTERNAL", "UNAVAILABLE", "CANCELLED"


class _Sender:
    def __init__(self):
        self.sent, self.cancelled, self.lock = [], False, threading.Lock()

    def send(self, response=None, flags=0):
        with self.lock:
            assert not self.finals, "a send after the final flag"
            self.sent.append((response, flags))

    @property
    def finals(self):
        return sum(1 for _, f in self.sent if f)

    def outputs(self):
        return [int(r.output_tensors[0].as_numpy().ravel()[0]) for r, _ in self.sent if r is not None and not r.err]

    def errors(self):
        return [r.err.message() for r, _ in self.sent if r is not None and r.err]

    def is_cancelled(self):
        return self.cancelled


class _Request:
    def __init__(self, key, value=None, *, start=False, end=False):
        self.key, self.tensors = key, {"x": None if value is None else np.array([[value]], np.int32)}
        self._flags = (1 if start else 0) | (2 if end else 0)
        self.sender = _Sender()

    def correlation_id(self):
        return self.key

    def flags(self):
        return self._flags

    def get_response_sender(self):
        return self.sender

    def parameters(self):
        return "{}"


PB = types.SimpleNamespace(
    TritonError=_Err, Tensor=pb_standin.Tensor, InferenceResponse=pb_standin.Response,
    TRITONSERVER_RESPONSE_COMPLETE_FINAL=1,
    get_input_tensor_by_name=lambda req, n: (None if req.tensors.get(n) is None
                                             else pb_standin.Tensor(n, req.tensors[n])))


def _echo(ctx):
    """Each piece's value, then (at END) -1."""
    for tensors, _end in ctx.pieces():
        v = int(tensors["x"].ravel()[0])
        if v < 0:
            ctx.reject(CosyVoiceError(f"x: bad value {v}"))
            continue
        ctx.send({"y": np.array([[v]], np.int32)})
        if v == 99:
            raise CosyVoiceError("x: 99 fails the session")
    if ctx.ended_by == "end":
        ctx.send({"y": np.array([[-1]], np.int32)})


def _sessions_of(handler=_echo, **kw):
    counts = []
    args = {"max_sessions": 2, "max_queued": 4, "idle_timeout_s": 30.0, "on_change": counts.append, **kw}
    return LiveSessions(PB, handler, ["x"], name="live", **args), counts


def _finals(*requests):
    wait_until(lambda: all(r.sender.finals == 1 for r in requests), "every piece answered", timeout=PATIENCE_S)


def test_sessions_answer_each_piece_on_its_sender_and_free_at_the_end():
    live, counts = _sessions_of()
    reqs = [_Request(7, 1, start=True), _Request(7, 2), _Request(7, 3, end=True)]
    for r in reqs:
        live.submit(r)
    _finals(*reqs)
    assert [r.sender.outputs() for r in reqs] == [[1], [2], [3, -1]]
    wait_until(lambda: live.active == 0, "the session freed")
    assert counts[0] == 1 and counts[-1] == 0
    late = _Request(7, 4)
    live.submit(late)
    assert late.sender.finals == 1 and "INVALID_ARGUMENT: live: no live session 7: it ended" in late.sender.errors()[0]
    live.close()


def test_the_end_of_a_session_the_model_finished_is_answered_without_an_error():
    """A handler that returns before the END (a live LM that stopped on its own): a later text piece is refused,
    the client's END is answered with an empty final response (no error), before and after the session is freed."""
    done = threading.Event()

    def stops_after_one(ctx):
        for tensors, _end in ctx.pieces():
            ctx.send({"y": np.array([[int(tensors["x"].ravel()[0])]], np.int32)})
            break
        done.set()

    live, _ = _sessions_of(stops_after_one)
    first = _Request(5, 1, start=True)
    live.submit(first)
    assert done.wait(PATIENCE_S)
    wait_until(lambda: live.active == 0, "the finished session freed")
    late, end = _Request(5, 2), _Request(5, None, end=True)
    for r in (late, end):
        live.submit(r)
    _finals(first, late, end)
    assert first.sender.outputs() == [1] and not first.sender.errors()
    assert "finished before its END" in late.sender.errors()[0]
    assert end.sender.finals == 1 and not end.sender.errors() and not end.sender.outputs()
    def stops_when_told(ctx):
        next(iter(ctx.pieces()))
        done.wait(PATIENCE_S)

    again = _Request(6, 1, start=True)  # an END queued while the model finishes: the same
    live2, _ = _sessions_of(stops_when_told)
    done.clear()
    live2.submit(again)
    end2 = _Request(6, None, end=True)
    live2.submit(end2)
    done.set()
    _finals(again, end2)
    assert not end2.sender.errors(), end2.sender.errors()
    live.close()
    live2.close()


def test_capacity_a_taken_id_and_a_missing_start_are_refused_at_once():
    live, _ = _sessions_of(max_sessions=1)
    a = _Request("a", 1, start=True)
    live.submit(a)
    wait_until(lambda: a.sender.outputs() == [1], "the first piece answered")
    refused = [_Request("b", 1, start=True), _Request("a", 1, start=True), _Request("c", 1), _Request(0, 1, start=True)]
    for r in refused:
        live.submit(r)
        assert r.sender.finals == 1  # at once, in submit()
    errors = [r.sender.errors()[0] for r in refused]
    assert errors[0].startswith("UNAVAILABLE: live: too many live sessions (1")
    assert errors[1].startswith("INVALID_ARGUMENT: live: session 'a' is already live")
    assert errors[2].startswith("INVALID_ARGUMENT: live: no live session 'c': it was never started")
    assert errors[3].startswith("INVALID_ARGUMENT: live: a live stream needs a sequence id")
    end = _Request("b", end=True)  # the refused stream's END: refused too, naming why
    live.submit(end)
    assert "was refused at its start" in end.sender.errors()[0]
    live.submit(_Request("a", 2, end=True))
    wait_until(lambda: live.active == 0, "the session freed")
    live.close()


def test_a_faster_sender_is_refused_beyond_the_queue_and_may_resend():
    gate = threading.Event()

    def slow(ctx):
        for tensors, _ in ctx.pieces():
            gate.wait(PATIENCE_S)
            ctx.send({"y": tensors["x"]})

    live, _ = _sessions_of(slow, max_queued=3)
    reqs = [_Request(1, 0, start=True)] + [_Request(1, k) for k in range(1, 8)]
    for r in reqs:
        live.submit(r)
    refused = [r for r in reqs if r.sender.finals]
    assert len(refused) >= 8 - 1 - 3 and all(r.sender.errors()[0].startswith("UNAVAILABLE:") for r in refused)
    assert "may be sent again" in refused[0].sender.errors()[0]
    gate.set()
    _finals(*reqs)
    again = _Request(1, 100, end=True)  # once the queue has room, the refused piece may come again
    live.submit(again)
    _finals(again)
    taken = [r for r in reqs if r not in refused]
    assert [r.sender.outputs()[0] for r in taken] == [int(r.tensors["x"].ravel()[0]) for r in taken]
    assert again.sender.outputs() == [100]
    live.close()


def test_a_bad_piece_is_refused_alone_and_a_failure_ends_the_session():
    gate = threading.Event()

    def handler(ctx):
        gate.wait(PATIENCE_S)
        _echo(ctx)

    live, _ = _sessions_of(handler)
    reqs = [_Request(5, 1, start=True), _Request(5, -3), _Request(5, 2), _Request(5, 99), _Request(5, 4)]
    for r in reqs:
        live.submit(r)
    gate.set()
    _finals(*reqs)
    assert [r.sender.outputs() for r in reqs] == [[1], [], [2], [99], []]
    assert reqs[1].sender.errors() == ["INVALID_ARGUMENT: x: bad value -3"]
    assert reqs[3].sender.errors() == ["INVALID_ARGUMENT: x: 99 fails the session"]
    assert "this piece was not taken" in reqs[4].sender.errors()[0]
    wait_until(lambda: live.active == 0, "the failed session freed")
    live.close()


def test_idle_and_vanished_sessions_are_freed():
    live, _ = _sessions_of(idle_timeout_s=0.3, sweep_s=0.05)
    idle = _Request("idle", 1, start=True)
    live.submit(idle)
    wait_until(lambda: live.active == 0, "the idle session freed")
    late = _Request("idle", 2)
    live.submit(late)
    assert "idle timeout" in late.sender.errors()[0]
    # arrival mode keeps the newest sender open: a client that went away is seen before the idle timeout
    live2, _ = _sessions_of(advance="arrival", idle_timeout_s=PATIENCE_S, sweep_s=0.05)
    gone = _Request("gone", 1, start=True)
    live2.submit(gone)
    wait_until(lambda: live2.active == 1, "the session held")
    gone.sender.cancelled = True
    wait_until(lambda: live2.active == 0, "the vanished client's session freed")
    assert gone.sender.finals == 1
    live.close()
    live2.close()


def test_arrival_mode_moves_the_current_sender_when_a_piece_arrives():
    seen = []

    def handler(ctx):
        for _tensors, _end in ctx.pieces():
            seen.append(ctx.received)
            ctx.send({"y": np.array([[ctx.received]], np.int32)})

    live, _ = _sessions_of(handler, advance="arrival")
    a = _Request(9, 1, start=True)
    live.submit(a)
    wait_until(lambda: a.sender.outputs() == [1], "the first piece answered")
    assert a.sender.finals == 0  # still the current sender
    b = _Request(9, 2, end=True)
    live.submit(b)
    assert a.sender.finals == 1  # closed when b arrived
    _finals(b)
    assert b.sender.outputs() == [2]
    live.close()


class _FreedSender(_Sender):
    """A sender whose response factory Triton frees with the final flag: asking it afterwards is a use after free
    (a segfault in the real backend). Once ``armed``, ``is_cancelled`` holds until ``release`` is set, to widen
    the race."""

    def __init__(self):
        super().__init__()
        self.armed, self.asking, self.release = threading.Event(), threading.Event(), threading.Event()
        self.asked_after_final = 0

    def is_cancelled(self):
        if self.finals:
            self.asked_after_final += 1
        if not self.armed.is_set():
            return False
        self.asking.set()
        self.release.wait(PATIENCE_S)
        if self.finals:
            self.asked_after_final += 1
        return False


def test_a_sender_closed_by_a_new_piece_is_never_asked_whether_it_was_cancelled():
    """Arrival mode closes the previous piece's sender from the execute thread while the worker asks the open
    senders whether the client went away: the close waits for the question, and a closed sender is never asked."""
    live, _ = _sessions_of(advance="arrival")
    first = _Request(4, 1, start=True)
    first.sender = _FreedSender()
    live.submit(first)
    wait_until(lambda: first.sender.outputs() == [1], "the first piece answered")
    ctx = live.sessions[4]
    first.sender.armed.set()
    asker = threading.Thread(target=ctx.cancelled)
    asker.start()
    assert first.sender.asking.wait(PATIENCE_S)
    second = _Request(4, 2, end=True)
    closer = threading.Thread(target=live.submit, args=(second,))  # closes `first`'s sender on arrival
    closer.start()
    closer.join(0.2)
    assert first.sender.finals == 0, "the sender was closed while it was being asked"
    first.sender.release.set()
    asker.join(PATIENCE_S)
    closer.join(PATIENCE_S)
    _finals(first, second)
    for _ in range(50):  # the worker asks the open senders before each piece: the closed one is not among them
        assert not ctx.cancelled()
    assert first.sender.asked_after_final == 0
    live.close()


# ------------------------------------------------------------------------------------------ rendered config
@pytest.mark.parametrize("flavor", ["local", "onnx", "trt"])
def test_the_live_model_is_rendered_with_a_sequence_batcher(serving_assets, tmp_path, flavor):
    import json as _json

    from google.protobuf import json_format, text_format
    from tritonclient.grpc import model_config_pb2

    from cosyvoice_triton.serving.repository import RenderError, render_repository
    from cosyvoice_triton.serving.stages.model_params import MODEL_PARAMS
    from cosyvoice_triton.serving.stages.params import read_parameters

    out = tmp_path / "repo"
    render_repository(flavor, out, model_dir=serving_assets["model_dir"], onnx_dir=serving_assets["onnx_dir"],
                      tts="off", allow_missing=True, live_max_sessions=3, live_idle_timeout_s=7.5,
                      live_chunk_tokens=50)
    cfg = text_format.Parse((out / LIVE_VC_MODEL / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
    assert cfg.model_transaction_policy.decoupled and cfg.max_batch_size == 1
    assert cfg.sequence_batching.oldest.max_candidate_sequences == 6
    assert cfg.sequence_batching.max_sequence_idle_microseconds == int(12.5e6)
    assert not cfg.HasField("dynamic_batching")
    p = read_parameters(_json.dumps(json_format.MessageToDict(cfg, preserving_proto_field_name=True)),
                        MODEL_PARAMS[LIVE_VC_MODEL], model=LIVE_VC_MODEL)
    assert (p["max_sessions"], p["idle_timeout_s"], p["chunk_tokens"]) == (3, 7.5, 50)
    # the cached flow window's flow runs where the graphs run
    assert p["stream_state"] and p["device"] == ("cpu" if flavor == "local" else "cuda")
    with pytest.raises(RenderError, match="tokenizer window"):
        render_repository(flavor, tmp_path / "bad", model_dir=serving_assets["model_dir"],
                          onnx_dir=serving_assets["onnx_dir"], tts="off", allow_missing=True,
                          live_tokenizer_context_tokens=900)


@pytest.fixture(scope="module")
def server(serving_assets, tmp_path_factory):
    from cosyvoice_triton.serving.repository import render_repository

    repo = tmp_path_factory.mktemp("live") / "model_repository"
    render_repository("local", repo, model_dir=serving_assets["model_dir"], onnx_dir=serving_assets["onnx_dir"],
                      tts="off", live_idle_timeout_s=IDLE_S, live_max_sessions=MAX_SESSIONS,
                      live_max_queued=MAX_QUEUED)
    with served(repo) as s:
        yield s


@pytest.fixture(scope="module")
def speech():
    return speech_pair(5.0, 2.0)


@pytest.fixture(scope="module")
def library(serving_assets):
    from cosyvoice_triton.serving.stages.local import LocalPipeline
    from cosyvoice_triton.serving.stages.stream_state import build_incremental
    from cosyvoice_triton.serving.stages.vc_stream import VCStreamer

    local = LocalPipeline(serving_assets["model_dir"], serving_assets["onnx_dir"] / "fp32")
    inc = build_incremental({}, serving_assets["model_dir"], local.config)  # the served default: the cached window
    return LiveVC(VCStreamer(local.pre, local.flow, {k: v.run for k, v in local.graphs.items()}, incremental=inc),
                  LiveSettings())


class Stream:
    """A minimal live client: one gRPC stream; responses and errors per piece (request id ``p<k>``)."""

    def __init__(self, server, sequence_id, model=LIVE_VC_MODEL):
        import tritonclient.grpc as grpcclient

        self.g, self.model, self.id = grpcclient, model, sequence_id
        self.client = grpcclient.InferenceServerClient(server.grpc_url)
        self.events: queue.Queue = queue.Queue()
        self.client.start_stream(callback=lambda result, error: self.events.put((time.monotonic(), result, error)))
        self.sent = 0
        self.sent_at: dict[str, float] = {}

    def _input(self, name, arr):
        dt = {np.float32: "FP32", np.int32: "INT32", np.int64: "INT64", np.object_: "BYTES"}[arr.dtype.type]
        t = self.g.InferInput(name, list(arr.shape), dt)
        t.set_data_from_numpy(arr)
        return t

    def send(self, tensors, *, start=False, end=False, sequence_id=None):
        rid = f"p{self.sent}"
        self.sent += 1
        self.sent_at[rid] = time.monotonic()
        self.client.async_stream_infer(self.model, [self._input(k, v) for k, v in tensors.items()],
                                       sequence_id=self.id if sequence_id is None else sequence_id,
                                       sequence_start=start, sequence_end=end, request_id=rid,
                                       enable_empty_final_response=True)
        return rid

    def collect(self, n_requests):
        """Until every one of ``n_requests`` pieces has its final response (or an error): {rid: outputs, errors}."""
        done, outs, errors, first_at = set(), {}, {}, None
        while len(done) < n_requests:
            t, result, error = self.events.get(timeout=PATIENCE_S)
            if error is not None:
                # "<gRPC status>: <message>" (the error's request id is not given back)
                errors.setdefault("_", []).append(f"{error.status()}: {error.message()}")
                done.add(f"err{len(errors['_'])}")
                continue
            r = result.get_response()
            if r.outputs:
                first_at = first_at or t
                outs.setdefault(r.id, []).append({o.name: result.as_numpy(o.name) for o in r.outputs})
            if r.parameters["triton_final_response"].bool_param:
                done.add(r.id)
        return outs, errors.get("_", []), first_at

    def close(self):
        self.client.stop_stream()
        self.client.close()


def send_paced(s: Stream, first: dict, pieces, pause_s: float = 0.2):
    """A live VC session on ``s``: each piece of source audio sent ``pause_s`` after the last (real time for 0.2 s
    pieces; the first with ``first``, the last with END): (outputs, errors, first answer's time, last piece's)."""
    for k, p in enumerate(pieces):
        s.send({**(first if k == 0 else {}), "source_audio": p[None]}, start=k == 0, end=k == len(pieces) - 1)
        time.sleep(pause_s)
    last_sent = max(s.sent_at.values())
    return (*s.collect(len(pieces)), last_sent)


def _first(ssr, prm, psr):
    return {"source_sample_rate": np.array([[ssr]], np.int32), "prompt_audio": prm[None],
            "prompt_sample_rate": np.array([[psr]], np.int32), "seed": np.array([[SEED]], np.int64)}


def _sessions(server, name: str = "cosyvoice_live_sessions") -> float:
    """The live VC model's gauge ``name`` (the sessions held; the streams' flow state and its bytes)."""
    from cosyvoice_triton.loadtest.metrics import parse_prometheus

    with urllib.request.urlopen(server.metrics_url, timeout=30) as r:
        series = parse_prometheus(r.read().decode())
    return sum(s.value for s in series if s.name == name and s.labels.get("model") == LIVE_VC_MODEL)


def _pieces(src, ssr, seconds=0.2):
    n = int(seconds * ssr)
    return [src[i: i + n] for i in range(0, len(src), n)]


def test_live_stream_equals_the_library(server, speech, library):
    src, ssr, prm, psr = speech
    pieces = _pieces(src, ssr)
    s = Stream(server, 101)
    try:
        outs, errors, first_at, last_sent = send_paced(s, _first(ssr, prm, psr), pieces)
    finally:
        s.close()
    assert not errors, errors
    chunks = sorted((int(o["chunk_index"].ravel()[0]), rid, o) for rid, os in outs.items() for o in os)
    assert [c[0] for c in chunks] == list(range(len(chunks))) and len(chunks) >= 4
    assert first_at < last_sent  # converted while the source was still arriving
    seconds = [float(o["source_seconds"].ravel()[0]) for _, _, o in chunks]
    assert seconds == sorted(seconds) and seconds[0] < seconds[-1] == pytest.approx(len(src) / ssr, abs=1e-3)
    # each chunk came on the sender of the piece that completed it
    for _, rid, o in chunks:
        k = int(rid[1:])
        assert float(o["source_seconds"].ravel()[0]) == pytest.approx(min(len(src), sum(map(len, pieces[: k + 1])))
                                                                      / ssr, abs=1e-3)
    want = convert_pieces(library, _first(ssr, prm, psr), pieces)
    assert len(chunks) == len(want)
    for (_, _, o), w in zip(chunks, want, strict=True):
        assert int(o["sample_rate"].ravel()[0]) == 24000
        assert rel_err(o["waveform"][0], w) < 1e-3
    wait_until(lambda: _sessions(server) == 0, "the ended session freed")
    wait_until(lambda: _sessions(server, "cosyvoice_stream_states") == 0, "its flow state freed")


def _expect_error(s, n, want):
    outs, errors, _ = s.collect(n)
    assert any(want in e for e in errors), errors
    return outs, errors


@pytest.mark.parametrize("case", ["rate", "empty", "oversized", "prompt_again"])
def test_a_bad_piece_is_refused_and_the_stream_goes_on(server, speech, case):
    src, ssr, prm, psr = speech
    bad = {"rate": {"source_audio": src[None, :100], "source_sample_rate": np.array([[16000]], np.int32)},
           "empty": {"source_audio": np.zeros((1, 0), np.float32)},
           "oversized": {"source_audio": np.zeros((1, 6 * ssr), np.float32)},
           "prompt_again": {"source_audio": src[None, :100], "prompt_audio": prm[None]}}[case]
    want = {"rate": "started at", "empty": "empty piece", "oversized": "longer than",
            "prompt_again": "only the first piece"}[case]
    s = Stream(server, f"bad-{case}")
    try:
        s.send({**_first(ssr, prm, psr), "source_audio": src[None, : ssr]}, start=True)
        s.send(bad)
        s.send({"source_audio": src[None, ssr:]}, end=True)
        outs, errors = _expect_error(s, 3, want)
    finally:
        s.close()
    assert len(errors) == 1 and "INVALID_ARGUMENT" in errors[0], errors
    total = sum(o["waveform"].shape[1] for os in outs.values() for o in os)
    assert total == int(np.ceil(len(src) * 16000 // ssr // 160 / 4)) * 960  # the bad piece was not taken


def test_piece_after_the_end_missing_start_and_a_taken_id(server, speech):
    src, ssr, prm, psr = speech
    s = Stream(server, 202)
    try:
        s.send({**_first(ssr, prm, psr), "source_audio": src[None, : ssr]}, start=True, end=True)
        s.collect(1)
        s.send({"source_audio": src[None, :100]})  # after the end
        _expect_error(s, 1, "START")  # Triton refuses a sequence's piece without START
        s.send({"source_audio": src[None, :100]}, sequence_id=203)  # never started
        _expect_error(s, 1, "START")
        s.send({**_first(ssr, prm, psr), "source_audio": src[None, : ssr // 2]}, start=True, sequence_id=204)
        s.send({**_first(ssr, prm, psr), "source_audio": src[None, : ssr // 2]}, start=True, sequence_id=204)
        outs, errors = _expect_error(s, 2, "already live")
        s.send({"source_audio": src[None, ssr // 2: ssr]}, end=True, sequence_id=204)  # the first one goes on
        outs, errors, _ = s.collect(1)
        assert not errors and outs
    finally:
        s.close()


def test_missing_prompt_or_rate_fails_the_session(server, speech):
    src, ssr, _, _ = speech
    s = Stream(server, 301)
    try:
        s.send({"source_audio": src[None, :ssr], "source_sample_rate": np.array([[ssr]], np.int32)}, start=True)
        s.send({"source_audio": src[None, ssr: 2 * ssr]}, end=True)
        outs, errors, _ = s.collect(2)
        assert any("prompt" in e for e in errors) and not outs, errors
        # the second piece is refused whenever it arrives: while the session fails ("was not taken"), after it has
        # closed ("has ended"), or once it is forgotten ("no live session"): which one depends on the machine's pace
        assert any(w in e for e in errors for w in ("was not taken", "has ended", "no live session")), errors
    finally:
        s.close()
    wait_until(lambda: _sessions(server) == 0, "the failed session freed")


def test_too_many_sessions_are_refused_at_once(server, speech):
    src, ssr, prm, psr = speech
    streams = [Stream(server, 400 + i) for i in range(MAX_SESSIONS + 1)]
    try:
        for s in streams[:MAX_SESSIONS]:
            s.send({**_first(ssr, prm, psr), "source_audio": src[None, : ssr // 5]}, start=True)
        wait_until(lambda: _sessions(server) == MAX_SESSIONS, "the sessions held")
        t0 = time.monotonic()
        streams[-1].send({**_first(ssr, prm, psr), "source_audio": src[None, : ssr // 5]}, start=True)
        _, errors = _expect_error(streams[-1], 1, "too many live sessions")
        assert "UNAVAILABLE" in errors[0] and time.monotonic() - t0 < PATIENCE_S / 10
        for s in streams[:MAX_SESSIONS]:
            s.send({"source_audio": src[None, ssr // 5: ssr]}, end=True)
            _, errors, _ = s.collect(2)
            assert not errors
    finally:
        for s in streams:
            s.close()
    wait_until(lambda: _sessions(server) == 0, "the sessions freed")


def test_a_sender_faster_than_real_time_is_refused_not_buffered(server, speech):
    src, ssr, prm, psr = speech
    pieces = _pieces(np.concatenate([src] * 3), ssr, 0.5)  # 15 s sent at once
    s = Stream(server, 501)
    try:
        for k, p in enumerate(pieces):
            s.send({**(_first(ssr, prm, psr) if k == 0 else {}), "source_audio": p[None]}, start=k == 0,
                   end=k == len(pieces) - 1)
        _, errors, _ = s.collect(len(pieces))
    finally:
        s.close()
    refused = [e for e in errors if "faster than it is converted" in e]
    assert refused and all("UNAVAILABLE" in e for e in refused), errors
    assert len(refused) <= len(pieces) - MAX_QUEUED - 1  # at most the queue's worth was held
    wait_until(lambda: _sessions(server) == 0, "the session freed")


def test_a_vanished_client_and_an_idle_stream_are_freed(server, speech):
    src, ssr, prm, psr = speech
    gone, idle = Stream(server, 601), Stream(server, 602)
    try:
        gone.send({**_first(ssr, prm, psr), "source_audio": src[None, : 2 * ssr]}, start=True)
        idle.send({**_first(ssr, prm, psr), "source_audio": src[None, : 2 * ssr]}, start=True)
        wait_until(lambda: _sessions(server) == 2, "two sessions held")
        # 2 s of source make a chunk: each session holds its cached flow window
        wait_until(lambda: _sessions(server, "cosyvoice_stream_states") == 2, "two sessions' flow state held")
        gone.close()  # no END: the client goes away
        idle.collect(1)
        wait_until(lambda: _sessions(server) == 0, "both sessions freed (cancelled or idle)",
                   timeout=IDLE_S * 3 + PATIENCE_S)
        wait_until(lambda: _sessions(server, "cosyvoice_stream_states") == 0, "their flow state freed")
        assert _sessions(server, "cosyvoice_stream_state_bytes") == 0
        idle.send({"source_audio": src[None, 2 * ssr: 3 * ssr]}, end=True)
        _, errors, _ = idle.collect(1)
        # the model's answer, or Triton's own where it forgot the sequence first (5 s after the model on a slow
        # machine)
        assert len(errors) == 1 and ("idle timeout" in errors[0] or "START" in errors[0]), errors
    finally:
        idle.close()
    # and the server still converts
    s = Stream(server, 603)
    try:
        s.send({**_first(ssr, prm, psr), "source_audio": src[None, : 2 * ssr]}, start=True, end=True)
        outs, errors, _ = s.collect(1)
        assert not errors and outs
    finally:
        s.close()


def test_concurrent_streams_do_not_mix(server, speech, library):
    """Two sessions at once, pieces interleaved: each equals its own library conversion. Each client sends its next
    piece once the last one is answered (two sessions on a busy machine can be slower than real time, and then
    the queue's limit refuses pieces: tested above)."""
    src, ssr, prm, psr = speech
    other = src[::-1].copy()
    results = {}

    def run(sid, y):
        s = Stream(server, sid)
        try:
            pieces = _pieces(y, ssr, 0.25)
            outs, errors = {}, []
            for k, p in enumerate(pieces):
                s.send({**(_first(ssr, prm, psr) if k == 0 else {}), "source_audio": p[None]}, start=k == 0,
                       end=k == len(pieces) - 1)
                o, e, _ = s.collect(1)
                outs.update(o)
                errors += e
            results[sid] = (pieces, outs, errors)
        finally:
            s.close()

    threads = [threading.Thread(target=run, args=(701, src)), threading.Thread(target=run, args=(702, other))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(PATIENCE_S)
    for sid in (701, 702):
        pieces, outs, errors = results[sid]
        assert not errors, errors
        got = np.concatenate([o["waveform"][0] for _, o in sorted(
            (int(o["chunk_index"].ravel()[0]), o) for os in outs.values() for o in os)])
        want = np.concatenate(convert_pieces(library, _first(ssr, prm, psr), pieces))
        assert rel_err(got, want) < 1e-3
