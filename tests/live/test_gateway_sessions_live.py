"""Live sessions are the tenant's own at the gateway: two tenants (two keys of a keys file) on one gateway in
front of a real tritonserver (local flavor, tiny demo model), on both live models (``cosyvoice_vc_live``,
``cosyvoice_tts_live``), over the gateway's gRPC ``ModelStreamInfer`` with Triton's own client. Tenant B opens a
session on a sequence id; tenant A, on the same id,

* sends a piece without a start: refused as an unknown id is (Triton's "must specify the START flag", naming A's
  own id), and no audio;
* sends the end (gRPC stream; also gRPC ``ModelInfer`` and HTTP ``/v2`` ``infer``, where Triton refuses a
  decoupled model): B's session goes on;
* sends a start: A's own session opens beside B's, and speaks A's input in A's voice;

and B finishes its session with the audio it gets alone. Afterwards Triton's ``cosyvoice_live_sessions`` and the
gateway's ``cosyvoice_gateway_sequences`` are back at 0. The id table itself, in process:
``test_gateway_sessions.py``."""

from __future__ import annotations

import json
import queue
import urllib.request

import numpy as np
import pytest
import soundfile as sf
from conftest import (
    FIXTURES,
    PATIENCE_S,
    PATIENT_TEST_S,
    gateway_process,
    http_post,
    live_models_served,
    rel_err,
    wait_until,
)

grpcclient = pytest.importorskip("tritonclient.grpc")

pytestmark = pytest.mark.timeout(PATIENT_TEST_S)

VC, TTS = "cosyvoice_vc_live", "cosyvoice_tts_live"
KEY_A, KEY_B = "sk-sessions-a", "sk-sessions-b"
SEED = 7
#: B's ids: an integer and a string one (both kinds of Triton correlation id); A's id that nobody opened.
IDS = [4242, "shared-session"]
NEVER = {4242: 4243, "shared-session": "never-opened"}


@pytest.fixture(scope="module")
def server(serving_assets, tmp_path_factory):
    """Both live models; the text of a live TTS session may pause 30 s (B waits while A tries its id)."""
    with live_models_served(serving_assets, tmp_path_factory.mktemp("sessions"), live_text_timeout_s=30.0) as s:
        yield s


@pytest.fixture(scope="module")
def gateway(server, tmp_path_factory):
    folder = tmp_path_factory.mktemp("sessions_gateway")
    with gateway_process(server, folder / "gateway.log", "--open-metrics",
                         tenants={"tenant_a": KEY_A, "tenant_b": KEY_B}) as urls:
        yield urls


@pytest.fixture(scope="module")
def audio():
    src, ssr = sf.read(FIXTURES / "source_en_5s.wav", dtype="float32")
    prm, psr = sf.read(FIXTURES / "prompt_en_3s.wav", dtype="float32")
    other, osr = sf.read(FIXTURES / "speech_engb_16k.wav", dtype="float32")
    return {"src": (src, ssr), "b": (prm[: int(1.5 * psr)], psr), "a": (other[: int(1.5 * osr)], osr)}


def _pieces(model, audio, who) -> list[dict[str, np.ndarray]]:
    """A session's pieces (the voice on the first): B's, or A's (another voice, other input)."""
    prm, psr = audio[who]
    if model == VC:
        src, ssr = audio["src"]
        at = 0 if who == "b" else int(2.0 * ssr)
        n = int(0.4 * ssr)
        pieces = [{"source_audio": src[None, at + i * n: at + (i + 1) * n]} for i in range(4)]
        pieces[0].update({"source_sample_rate": np.array([[ssr]], np.int32), "prompt_audio": prm[None],
                          "prompt_sample_rate": np.array([[psr]], np.int32),
                          "seed": np.array([[SEED]], np.int64)})
        return pieces
    text = (["Hello there, ", "this is the ", "second tenant ", "speaking live."] if who == "b"
            else ["Another voice ", "says something ", "else entirely, ", "at the same time."])
    pieces = [{"text": np.array([[t.encode()]], object)} for t in text]
    pieces[0].update({"prompt_audio": prm[None], "prompt_sample_rate": np.array([[psr]], np.int32),
                      "prompt_text": np.array([[b"A prompt."]], object), "seed": np.array([[SEED]], np.int64)})
    return pieces


def _end(model) -> dict[str, np.ndarray]:
    """The last piece of a session: no audio / no text, with the sequence's end."""
    if model == VC:
        return {"source_audio": np.zeros((1, 0), np.float32)}
    return {"text": np.array([[b""]], object)}


class Tenant:
    """One gRPC stream at the gateway with a tenant's key: what each of its requests got (audio, final, error).
    Requests are answered in the order sent (each error answers one request: Triton's stream errors carry no
    request id)."""

    def __init__(self, gateway, key):
        self.client = grpcclient.InferenceServerClient(gateway.grpc)
        self.events: queue.Queue = queue.Queue()
        self.client.start_stream(callback=lambda result, error: self.events.put((result, error)),
                                 headers={"authorization": f"Bearer {key}"})
        self.sent, self.audio, self.finals, self.errors = 0, [], set(), []

    def send(self, model, tensors, sequence_id, *, start=False, end=False) -> None:
        inputs = []
        for name, arr in tensors.items():
            dt = {np.float32: "FP32", np.int32: "INT32", np.int64: "INT64", np.object_: "BYTES"}[arr.dtype.type]
            t = grpcclient.InferInput(name, list(arr.shape), dt)
            t.set_data_from_numpy(arr)
            inputs.append(t)
        self.client.async_stream_infer(model, inputs, sequence_id=sequence_id, sequence_start=start,
                                       sequence_end=end, request_id=f"p{self.sent}", enable_empty_final_response=True)
        self.sent += 1

    def pump(self) -> int:
        """Take the answers that have come; -> how many requests are answered (final or error)."""
        while True:
            try:
                result, error = self.events.get_nowait()
            except queue.Empty:
                return len(self.finals) + len(self.errors)
            if error is not None:
                self.errors.append(error.message())
                continue
            r = result.get_response()
            if r.outputs and result.as_numpy("waveform").size:
                self.audio.append((int(result.as_numpy("chunk_index").ravel()[0]), result.as_numpy("waveform")))
            if r.parameters["triton_final_response"].bool_param:
                self.finals.add(r.id)

    def wait_answered(self, what: str) -> None:
        """Until every request sent is answered."""
        wait_until(lambda: self.pump() >= self.sent, what)

    def waveform(self) -> np.ndarray:
        chunks = sorted(self.audio, key=lambda c: c[0])
        assert [c[0] for c in chunks] == list(range(len(chunks))), [c[0] for c in chunks]
        return np.concatenate([w[0] for _, w in chunks])

    def close(self) -> None:
        self.client.stop_stream()
        self.client.close()


def _metric(url: str, name: str, model: str | None = None) -> float:
    from cosyvoice_triton.loadtest.metrics import parse_prometheus

    with urllib.request.urlopen(url, timeout=30) as r:
        series = parse_prometheus(r.read().decode())
    return sum(s.value for s in series if s.name == name and (model is None or s.labels.get("model") == model))


def _live(server, model) -> float:
    return _metric(server.metrics_url, "cosyvoice_live_sessions", model)


def _open_ids(gateway) -> float:
    return _metric(gateway.base + "/metrics", "cosyvoice_gateway_sequences")


def _session(gateway, key, model, pieces, sequence_id) -> np.ndarray:
    """A whole session alone: its waveform."""
    t = Tenant(gateway, key)
    try:
        for k, piece in enumerate(pieces):
            t.send(model, piece, sequence_id, start=k == 0)
        t.send(model, _end(model), sequence_id, end=True)
        t.wait_answered(f"{model}: a session alone")
        assert not t.errors, t.errors
        return t.waveform()
    finally:
        t.close()


@pytest.fixture(scope="module")
def alone(gateway, audio):
    """Each tenant's session on each model, alone (no one else on its id): what it must get with A around too."""
    cache = {}

    def get(model, who):
        if (model, who) not in cache:
            cache[model, who] = _session(gateway, KEY_B if who == "b" else KEY_A, model,
                                         _pieces(model, audio, who), f"alone-{who}")
        return cache[model, who]

    return get


class Scene:
    """B's session open on ``sid`` (its first piece sent and live on Triton), A's stream beside it."""

    def __init__(self, server, gateway, audio, model, sid):
        self.server, self.gateway, self.model, self.sid = server, gateway, model, sid
        self.b_pieces, self.a_pieces = _pieces(model, audio, "b"), _pieces(model, audio, "a")
        self.b, self.a = Tenant(gateway, KEY_B), Tenant(gateway, KEY_A)
        self.b_next, self.b_refused = 1, []  # B's own requests refused (its start again)
        wait_until(lambda: _live(server, model) == 0, f"{model}: no live session left from an earlier test")
        self.b.send(model, self.b_pieces[0], sid, start=True)
        wait_until(lambda: self.b.pump() >= 0 and (self.b.errors or _live(server, model) >= 1),
                   "B's session live on Triton")
        assert not self.b.errors, self.b.errors

    def b_continues(self) -> None:
        """B's next piece, if it has one left."""
        if self.b_next < len(self.b_pieces):
            self.b.send(self.model, self.b_pieces[self.b_next], self.sid)
            self.b_next += 1

    def b_finishes(self) -> np.ndarray:
        while self.b_next < len(self.b_pieces):
            self.b_continues()
        self.b.send(self.model, _end(self.model), self.sid, end=True)
        self.b.wait_answered("B's session to its end")
        assert self.b.errors == self.b_refused, self.b.errors
        return self.b.waveform()

    def b_starts_again(self) -> str:
        """B's start on its own live id, refused (answered with Triton's words, B's id): the message."""
        before = len(self.b.errors)
        self.b.send(self.model, self.b_pieces[0], self.sid, start=True)
        wait_until(lambda: self.b.pump() >= 0 and len(self.b.errors) > before, "B's second start refused")
        self.b_refused.append(self.b.errors[before])
        return self.b.errors[before]

    def a_tries(self, tensors, sequence_id=None, **flags) -> tuple[list[str], list]:
        """One request of A on ``sequence_id`` (default B's), answered: (its errors, its audio)."""
        errors, audio = len(self.a.errors), len(self.a.audio)
        self.a.send(self.model, tensors, self.sid if sequence_id is None else sequence_id, **flags)
        self.a.wait_answered("A's request answered")
        return self.a.errors[errors:], self.a.audio[audio:]

    def all_freed(self) -> None:
        wait_until(lambda: _live(self.server, self.model) == 0, f"{self.model}: every live session freed")
        wait_until(lambda: _open_ids(self.gateway) == 0, "the gateway's sequence ids freed")

    def close(self) -> None:
        self.a.close()
        self.b.close()


@pytest.fixture
def scene(server, gateway, audio, request):
    model, sid = request.param
    s = Scene(server, gateway, audio, model, sid)
    try:
        yield s
    finally:
        s.close()


CASES = [(m, i) for m in (VC, TTS) for i in IDS]
IDS_OF = [f"{m}-{type(i).__name__}" for m, i in CASES]


@pytest.mark.parametrize("scene", CASES, ids=IDS_OF, indirect=True)
def test_a_piece_on_another_tenants_id_is_refused_as_an_unknown_id_is(scene, alone):
    never = NEVER[scene.sid]
    unknown, audio = scene.a_tries(scene.a_pieces[1], never)
    assert len(unknown) == 1 and "START" in unknown[0] and str(never) in unknown[0] and not audio, unknown
    scene.b_continues()
    errors, audio = scene.a_tries(scene.a_pieces[1])  # no start, on B's live id
    assert errors == [unknown[0].replace(str(never), str(scene.sid))] and not audio, (errors, len(audio))
    scene.b_continues()
    errors, audio = scene.a_tries(scene.a_pieces[2])  # and again: still nothing of B's
    assert len(errors) == 1 and not audio, (errors, len(audio))
    assert rel_err(scene.b_finishes(), alone(scene.model, "b")) < 1e-3
    scene.all_freed()


@pytest.mark.parametrize("scene", CASES, ids=IDS_OF, indirect=True)
def test_an_end_on_another_tenants_id_ends_nothing_of_theirs(scene, gateway, alone):
    errors, audio = scene.a_tries(_end(scene.model), end=True)
    assert len(errors) == 1 and "START" in errors[0] and str(scene.sid) in errors[0] and not audio, errors
    scene.b_continues()
    # the same end by gRPC ModelInfer and HTTP /v2 infer: Triton serves decoupled models over neither
    client = grpcclient.InferenceServerClient(gateway.grpc)
    try:
        end = _end(scene.model)
        name, arr = next(iter(end.items()))
        t = grpcclient.InferInput(name, list(arr.shape), "FP32" if arr.dtype == np.float32 else "BYTES")
        t.set_data_from_numpy(arr)
        with pytest.raises(grpcclient.InferenceServerException):
            client.infer(scene.model, [t], sequence_id=scene.sid, sequence_end=True, client_timeout=PATIENCE_S,
                         headers={"authorization": f"Bearer {KEY_A}"})
    finally:
        client.close()
    data = [""] if scene.model == TTS else []
    body = json.dumps({"parameters": {"sequence_id": scene.sid, "sequence_end": True},
                       "inputs": [{"name": name, "shape": list(arr.shape), "datatype": t.datatype(),
                                   "data": data}]}).encode()
    status, answer = http_post(gateway.http, f"/v2/models/{scene.model}/infer", body,
                               {"content-type": "application/json", "authorization": f"Bearer {KEY_A}"})
    assert status >= 400, (status, answer[:300])
    scene.b_continues()
    assert _live(scene.server, scene.model) >= 1  # B's session is still there
    assert rel_err(scene.b_finishes(), alone(scene.model, "b")) < 1e-3
    scene.all_freed()


@pytest.mark.parametrize("scene", CASES, ids=IDS_OF, indirect=True)
def test_a_start_on_another_tenants_id_opens_its_own_session(scene, alone):
    a, model = scene.a, scene.model
    a.send(model, scene.a_pieces[0], scene.sid, start=True)
    wait_until(lambda: a.pump() >= 0 and (a.errors or _live(scene.server, model) >= 2),
               "A's own session live beside B's")
    assert not a.errors, a.errors
    again = scene.b_starts_again()  # within a tenant nothing changed: its own id is "already live", named as sent
    assert "already live" in again and f"session {scene.sid!r} " in again, again
    scene.b_continues()
    for piece in scene.a_pieces[1:]:
        a.send(model, piece, scene.sid)
    a.send(model, _end(model), scene.sid, end=True)
    scene.b_continues()
    a.wait_answered("A's session to its end")
    assert not a.errors, a.errors
    assert rel_err(a.waveform(), alone(model, "a")) < 1e-3
    assert rel_err(scene.b_finishes(), alone(model, "b")) < 1e-3
    scene.all_freed()


@pytest.mark.parametrize("sid", IDS, ids=["int", "str"])
def test_http_answers_name_the_clients_own_id(gateway, audio, sid):
    """Triton's HTTP answer repeats the request's ``sequence_id`` (a model without a sequence batcher runs the
    request as any other): the client reads its own id there, never the gateway's."""
    src, ssr = audio["src"]
    prm, psr = audio["b"]
    body = json.dumps({"parameters": {"sequence_id": sid}, "inputs": [
        {"name": "source_audio", "shape": [1, ssr], "datatype": "FP32", "data": src[:ssr].tolist()},
        {"name": "source_sample_rate", "shape": [1, 1], "datatype": "INT32", "data": [ssr]},
        {"name": "prompt_audio", "shape": [1, len(prm)], "datatype": "FP32", "data": prm.tolist()},
        {"name": "prompt_sample_rate", "shape": [1, 1], "datatype": "INT32", "data": [psr]}]}).encode()
    status, answer = http_post(gateway.http, "/v2/models/cosyvoice_vc/infer", body,
                               {"content-type": "application/json", "authorization": f"Bearer {KEY_A}"})
    assert status == 200, answer[:300]
    head = json.loads(answer)
    assert head["parameters"]["sequence_id"] == sid and head["outputs"], head.get("parameters")
