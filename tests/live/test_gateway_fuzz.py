"""The gateway's door under a fuzzer (Hypothesis): the real gateway (uvicorn and h11 as in production, its KServe
gRPC port on, two tenants' keys) in front of a stand-in Triton and speech backend (``standin_gateway.py``: no
model runs, so each example costs milliseconds), fed over raw sockets and gRPC channels:

* headers: hostile names and values (control bytes, duplicates of the framing headers, long values, odd keys and
  request ids) on an ordinary speech request;
* chunked framing: chunk sizes with leading zeros, upper case, extensions, trailers; sizes that lie about their
  data, truncated bodies;
* JSON: whole bodies drawn from a recursive strategy, valid OpenAI and KServe bodies with fields replaced by any
  JSON value or unknown fields added, and valid bodies with bytes flipped, cut or inserted;
* multipart uploads (the voices and the CosyVoice form routes): hostile boundaries, part names, file names, part
  headers, audio that is not audio, parts missing or repeated, no closing boundary;
* the live sessions' gRPC frames (``ModelStreamInfer`` / ``ModelInfer`` on both live models): sequence ids of
  every parameter type, start and end flags missing, repeated or of the wrong type, inputs of wrong names, dtypes,
  shapes and contents; and bytes that are not a protobuf message at all.

The property, for every example: the gateway answers (a well-framed HTTP request always gets an answer; a
malformed one an answer or a closed connection, never a hang), never with a 5xx, and a refusal is a 4xx whose JSON
names the problem (h11's own refusal of an unparsable request is its plain ``Invalid HTTP request received.``);
a gRPC call ends OK or with a client's-fault code naming the problem, never UNKNOWN / INTERNAL / UNAVAILABLE. After
each run the gateway still answers ``/health``, an innocent speech request and an innocent live session of the
other tenant.

Short in the suite (``COSYVOICE_FUZZ_EXAMPLES``, default 60 per property, derandomized: the same examples each
run); the long run draws fresh examples: ``make fuzz`` (``COSYVOICE_FUZZ_EXAMPLES=5000``, random seeds)."""

from __future__ import annotations

import base64
import contextlib
import http.client
import io
import json
import os
import socket
import subprocess
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest
import soundfile as sf
from conftest import PATIENCE_S, PATIENT_TEST_S, gateway_running
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from test_gateway_sessions import _grpc_piece
from tritonclient.grpc import service_pb2, service_pb2_grpc

pytestmark = pytest.mark.timeout(PATIENT_TEST_S)

KEY, OTHER = "sk-fuzz-attacker", "sk-fuzz-innocent"
AUTH = f"Bearer {KEY}"
VC_LIVE, TTS_LIVE = "cosyvoice_vc_live", "cosyvoice_tts_live"
EXAMPLES = int(os.environ.get("COSYVOICE_FUZZ_EXAMPLES", "60"))
LONG = "COSYVOICE_FUZZ_EXAMPLES" in os.environ and EXAMPLES > 200
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=not LONG, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])
#: h11's own answer to a request it cannot parse (uvicorn sends it before any application code runs)
H11_REFUSAL = b"Invalid HTTP request received."
SPEECH = {"model": "cosyvoice2", "input": "Hello there.", "voice": "alice", "response_format": "pcm"}
#: A KServe body for cosyvoice_vc that the checks pass (the stand-in Triton answers it).
VC_BODY = {"inputs": [{"name": "source_audio", "datatype": "FP32", "shape": [1, 4], "data": [0.0, 0.1, 0.2, 0.3]},
                      {"name": "source_sample_rate", "datatype": "INT32", "shape": [1, 1], "data": [16000]},
                      {"name": "prompt_audio", "datatype": "FP32", "shape": [1, 2], "data": [0.0, 0.1]},
                      {"name": "prompt_sample_rate", "datatype": "INT32", "shape": [1, 1], "data": [16000]}]}


def _wav(seconds: float = 0.3, rate: int = 16000) -> bytes:
    buf = io.BytesIO()
    t = np.arange(int(seconds * rate)) / rate
    sf.write(buf, (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32), rate, format="WAV", subtype="PCM_16")
    return buf.getvalue()


WAV = _wav()


# ------------------------------------------------------------------------------------------- the gateway


class Door:
    def __init__(self, http: str, grpc_address: str, proc: subprocess.Popen, log: Path):
        self.http, self.grpc, self.proc, self.log = http, grpc_address, proc, log
        self.host, port = http.split(":")
        self.port = int(port)

    def alive(self) -> None:
        assert self.proc.poll() is None, f"the gateway exited ({self.proc.returncode}): {self.log.read_text()[-3000:]}"


@pytest.fixture(scope="module")
def door(tmp_path_factory):
    from cosyvoice_triton.serving.launch.server import free_ports

    port, grpc_port = free_ports(2)
    log = tmp_path_factory.mktemp("fuzz_gateway") / "gateway.log"
    script = Path(__file__).with_name("standin_gateway.py")
    http = f"127.0.0.1:{port}"
    with gateway_running([str(script), str(port), str(grpc_port), KEY, OTHER], log, http) as proc:
        yield Door(http, f"127.0.0.1:{grpc_port}", proc, log)
    assert "Traceback" not in log.read_text(), log.read_text()[-5000:]


@pytest.fixture(autouse=True)
def still_serves(door):
    """After each fuzz run: the gateway answers /health, an innocent speech request and the other tenant's live
    session."""
    yield
    door.alive()
    assert urllib.request.urlopen(f"http://{door.http}/health", timeout=PATIENCE_S).status == 200
    status, _, body = exchange(door, request("POST", "/v1/audio/speech", json.dumps(SPEECH).encode(),
                                             {"authorization": f"Bearer {OTHER}", "content-type": "application/json"}))
    assert status == 200 and len(body) == 2 * 2400, (status, body[:300])
    answers, code, _ = live_stream(door, [_piece(VC_LIVE, 9001, start=True), _piece(VC_LIVE, 9001, end=True)],
                                   key=OTHER)
    assert code == grpc.StatusCode.OK and [a.error_message for a in answers] == ["", ""], answers


# ------------------------------------------------------------------------------------------- HTTP, raw


def request(method: str, path: str, body: bytes | None, headers: dict[str, str] | list[tuple[str, str]],
            *, chunked_body: bytes | None = None) -> bytes:
    """An HTTP/1.1 request's bytes: the headers as given (a list keeps duplicates), a Content-Length for ``body``
    unless the headers give framing, or ``chunked_body`` as it is after ``Transfer-Encoding: chunked``."""
    items = list(headers.items()) if isinstance(headers, dict) else list(headers)
    names = {k.lower() for k, _ in items}
    head = [f"{method} {path} HTTP/1.1".encode(), b"host: fuzz"]
    if chunked_body is not None:
        items.append(("transfer-encoding", "chunked"))
    elif body is not None and not names & {"content-length", "transfer-encoding"}:
        items.append(("content-length", str(len(body))))
    head += [k.encode("latin-1") + b": " + v.encode("latin-1") for k, v in items]
    return b"\r\n".join(head) + b"\r\n\r\n" + (chunked_body if chunked_body is not None else body or b"")


def exchange(door: Door, data: bytes, *, half_close: bool = False) -> tuple[int | None, str, bytes]:
    """Send ``data`` on a connection of its own: (status, content type, body) of the answer, or (None, "", b"")
    when the gateway closed the connection without one. ``half_close``: the client sends nothing more (a body
    that lies about its length ends there instead of holding the connection)."""
    with socket.create_connection((door.host, door.port), timeout=PATIENCE_S) as sock:
        try:
            sock.sendall(data)
            if half_close:
                sock.shutdown(socket.SHUT_WR)
        except (BrokenPipeError, ConnectionResetError):  # refused before all of it was read
            pass
        resp = http.client.HTTPResponse(sock)
        try:
            resp.begin()
        except (http.client.RemoteDisconnected, ConnectionResetError):
            return None, "", b""
        try:
            body = resp.read()
        except http.client.IncompleteRead as exc:
            body = exc.partial
        return resp.status, resp.getheader("content-type", ""), body


def assert_refusal_or_answer(status: int | None, content_type: str, body: bytes, *, framed: bool = True) -> None:
    """The property of every HTTP answer: one comes (when the request was well framed), it is not a 5xx, and a
    refusal's body names the problem in JSON (OpenAI's shape, or KServe's ``{"error": "..."}``)."""
    if status is None:
        assert not framed, "a well-framed request got no answer (the connection was closed)"
        return
    assert status < 500, (status, body[:500])
    if status < 400:
        return
    if body == H11_REFUSAL:  # h11 could not parse the request: uvicorn's fixed answer, before the app
        assert status == 400
        return
    assert content_type.startswith("application/json"), (status, content_type, body[:300])
    error = json.loads(body)["error"]
    message = error if isinstance(error, str) else error["message"]
    assert isinstance(message, str) and message.strip(), body[:300]


# ------------------------------------------------------------------------------------------- headers

_TOKEN = st.text(st.sampled_from("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789!#$%&'*+-.^_`|~"),
                 min_size=1, max_size=40)
HEADER_NAMES = st.one_of(
    st.sampled_from(["content-type", "content-encoding", "authorization", "x-request-id", "expect", "connection",
                     "accept", "accept-encoding", "origin", "cookie", "user-agent", "range", "upgrade", "te",
                     "x-forwarded-for", "inference-header-content-length", "triton_grpc_error"]),
    _TOKEN,
    st.text(st.characters(min_codepoint=0, max_codepoint=255), min_size=1, max_size=20))  # not tokens at all
HEADER_VALUES = st.one_of(
    st.text(st.characters(min_codepoint=0, max_codepoint=255), max_size=300),
    st.sampled_from(["gzip", "br, identity", "chunked", "100-continue", "close", "keep-alive", "application/json",
                     "application/json; charset=utf-16", "multipart/form-data", "text/plain", "Bearer ",
                     "Bearer " + KEY + " x", "bearer " + KEY, "Basic " + base64.b64encode(b"a:b").decode(),
                     "h2c", "../../../../etc/passwd", "\u00ff" * 100, "x" * 9000, "0" * 40, "-1", "99999999999"]))


@given(extra=st.lists(st.tuples(HEADER_NAMES, HEADER_VALUES), max_size=8),
       path=st.sampled_from(["/v1/audio/speech", "/v2/models/cosyvoice_vc/infer", "/health", "/v1/audio/voices"]))
@example(extra=[("content-encoding", "gzip")], path="/v1/audio/speech")
@example(extra=[("content-type", "application/json" + ";" * 2000)], path="/v1/audio/speech")
@example(extra=[("x-request-id", "\x00" * 10)], path="/v1/audio/speech")
@FUZZ
def test_hostile_headers_get_an_answer_never_a_5xx(door, extra, path):
    body = _valid_body(path)
    headers = [("authorization", AUTH), ("content-type", "application/json"),
               *[(k, v) for k, v in extra if k.lower() not in ("content-length", "transfer-encoding", "host")]]
    method = "GET" if path == "/health" else "POST"
    assert_refusal_or_answer(*exchange(door, request(method, path, body, headers), half_close=False))


# ------------------------------------------------------------------------------------------- chunked framing

@st.composite
def chunked(draw, body: bytes):
    """``body`` in chunks as a hostile client frames them: -> (the framing's bytes, whether it is well framed)."""
    out, at, framed = [], 0, True
    while at < len(body):
        n = draw(st.integers(1, max(1, len(body) - at)))
        size = format(n, draw(st.sampled_from(["x", "X"])))
        size = "0" * draw(st.integers(0, 3)) + size
        ext = draw(st.sampled_from(["", ";a=b", ";ext", ';q="quoted"', "; x = y", ";\x01", ";" + "e" * 300]))
        lie = draw(st.sampled_from([0] * 6 + [-1, 1, 1000]))
        if lie or "\x01" in ext or " " in ext:
            framed = False
        declared = max(n + lie, 0)
        out.append(f"{declared:x}{ext}\r\n".encode() if lie else f"{size}{ext}\r\n".encode())
        out.append(body[at: at + n] + b"\r\n")
        at += n
    ending = draw(st.sampled_from(["0\r\n\r\n", "0\r\nx-trailer: 1\r\n\r\n", "000\r\n\r\n", "0;e=1\r\n\r\n",
                                   "", "0\r\n", "ffffffffffffffff\r\n", "zz\r\n\r\n", "0\r\nbad trailer\r\n\r\n"]))
    if ending in ("", "0\r\n", "ffffffffffffffff\r\n", "zz\r\n\r\n", "0\r\nbad trailer\r\n\r\n"):
        framed = False
    return b"".join(out) + ending.encode(), framed


def _valid_body(path: str) -> bytes:
    return json.dumps(VC_BODY if path.startswith("/v2") else SPEECH).encode()


@given(case=st.sampled_from(["/v1/audio/speech", "/v2/models/cosyvoice_vc/infer"]).flatmap(
    lambda path: st.tuples(st.just(path), chunked(_valid_body(path)))))
@FUZZ
def test_chunked_framing_is_answered_or_closed_never_a_5xx(door, case):
    path, (framing, framed) = case
    raw = request("POST", path, None, {"authorization": AUTH, "content-type": "application/json"},
                  chunked_body=framing)
    # a well-framed body is answered on the open connection; a malformed one ends where the client stops sending
    assert_refusal_or_answer(*exchange(door, raw, half_close=not framed), framed=framed)


def test_chunked_and_content_length_together_are_refused(door):
    raw = request("POST", "/v1/audio/speech", None, {"authorization": AUTH, "content-length": "5"},
                  chunked_body=b"5\r\nhello\r\n0\r\n\r\n")
    status, _, body = exchange(door, raw)
    assert status == 400 and json.loads(body)["error"]["code"] == "ambiguous_framing", body


# ------------------------------------------------------------------------------------------- JSON

_SURROGATES = st.sampled_from(["\ud800", "\udfff", "a\udc00b"])
_TEXT = st.one_of(st.text(max_size=40), _SURROGATES, st.sampled_from(["", " ", "\x00", "é" * 50, "[" * 30]))
_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(), st.integers(-(2**70), 2**70),
                     st.floats(allow_nan=False), _TEXT)
JSON_VALUES = st.recursive(_SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=5),
                                                             st.dictionaries(_TEXT, inner, max_size=5)),
                           max_leaves=30)


def _dumps(value) -> bytes:
    return json.dumps(value, allow_nan=True).encode("utf-8", "surrogatepass")


def post_json(door: Door, path: str, body: bytes, key: str = KEY):
    return exchange(door, request("POST", path, body, {"authorization": f"Bearer {key}",
                                                       "content-type": "application/json"}))


@given(value=JSON_VALUES, path=st.sampled_from(["/v1/audio/speech", "/v2/models/cosyvoice_vc/infer",
                                                "/v2/models/cosyvoice_tts_live/infer"]))
# found by the fuzzer: a lone surrogate in an unknown field's name was named in the refusal, which Starlette's JSON
# could not encode (500); refusals are ASCII JSON now (gateway/errors.py ErrorResponse)
@example(value={"\ud800": None}, path="/v2/models/cosyvoice_vc/infer")
@example(value={"\ud800": None}, path="/v1/audio/speech")
@FUZZ
def test_any_json_body_is_answered_never_a_5xx(door, value, path):
    assert_refusal_or_answer(*post_json(door, path, _dumps(value)))


@given(field=st.sampled_from([*SPEECH, "reference_audio", "reference_text", "instructions", "speed", "seed",
                              "stream_format", "unknown"]), value=JSON_VALUES)
@example(field="input", value="hi \ud800")
@example(field="reference_text", value="\udfff")
@example(field="seed", value=2**64)
@example(field="speed", value=1e308)
@example(field="reference_audio", value="data:audio/wav;base64,////")
@FUZZ
def test_speech_fields_of_any_json_value_are_answered_never_a_5xx(door, field, value):
    assert_refusal_or_answer(*post_json(door, "/v1/audio/speech", _dumps({**SPEECH, field: value})))


@given(at=st.integers(0, 3), field=st.sampled_from(["name", "datatype", "shape", "data", "parameters", "unknown"]),
       value=JSON_VALUES, top=st.sampled_from([None, "id", "parameters", "outputs", "inputs"]), top_value=JSON_VALUES)
@example(at=0, field="shape", value=[2**62, 2**62], top=None, top_value=None)
@example(at=1, field="data", value=[2**40], top=None, top_value=None)
@example(at=0, field="datatype", value="BYTES", top="parameters", top_value={"sequence_id": -1})
@FUZZ
def test_kserve_fields_of_any_json_value_are_answered_never_a_5xx(door, at, field, value, top, top_value):
    body = json.loads(json.dumps(VC_BODY))
    body["inputs"][at][field] = value
    if top is not None:
        body[top] = top_value
    assert_refusal_or_answer(*post_json(door, "/v2/models/cosyvoice_vc/infer", _dumps(body)))


@given(path=st.sampled_from(["/v1/audio/speech", "/v2/models/cosyvoice_vc/infer"]),
       edits=st.lists(st.tuples(st.floats(0, 1), st.sampled_from(["flip", "cut", "insert"]), st.binary(max_size=4)),
                      min_size=1, max_size=6))
@FUZZ
def test_mutated_valid_bodies_are_answered_never_a_5xx(door, path, edits):
    body = bytearray(_valid_body(path))
    for where, how, data in edits:
        i = min(int(where * len(body)), max(len(body) - 1, 0))
        if how == "flip" and body:
            body[i] ^= 1 << (data[0] % 8 if data else 0)
        elif how == "cut":
            del body[i: i + 1 + len(data)]
        else:
            body[i:i] = data
    assert_refusal_or_answer(*post_json(door, path, bytes(body)))


# ------------------------------------------------------------------------------------------- multipart uploads

_BOUNDARY = st.one_of(st.text(st.sampled_from("abcXYZ0129'()+_,-./:=? "), min_size=1, max_size=80),
                      st.sampled_from(["", '"quoted"', "a" * 71, "--", "\u00e9", "x\r\ny", "x;y", "B"]))
_PART_NAME = st.one_of(st.sampled_from(["id", "audio", "text", "source_wav", "prompt_wav", "spk_id", "tts_text",
                                        "prompt_text"]), _TEXT)
_FILENAME = st.one_of(st.none(), st.sampled_from(["v.wav", "../../etc/passwd", "a\"b.wav", "x\r\nContent-Type: y",
                                                  "\u202e.wav", "", "a" * 5000]), _TEXT)
_CONTENT = st.one_of(st.just(WAV), st.just(WAV[:44]), st.just(WAV[:100]), st.binary(max_size=200),
                     st.just(b"RIFF\xff\xff\xff\xffWAVEfmt "), st.just(b""), _TEXT.map(lambda t: t.encode("utf-8",
                                                                                                       "surrogatepass")))


@st.composite
def multipart(draw):
    """-> (Content-Type, body) of a form with hostile parts."""
    boundary = draw(_BOUNDARY)
    parts = []
    for _ in range(draw(st.integers(0, 5))):
        name, filename = draw(_PART_NAME), draw(_FILENAME)
        disposition = f'form-data; name="{name}"' + ("" if filename is None else f'; filename="{filename}"')
        headers = [f"Content-Disposition: {disposition}"]
        if draw(st.booleans()):
            headers.append(f"Content-Type: {draw(st.sampled_from(['audio/wav', 'text/plain', 'x/y; a=b', '']))}")
        if draw(st.integers(0, 9)) == 0:
            headers.append(draw(st.sampled_from(["Content-Transfer-Encoding: base64", "X: " + "y" * 3000,
                                                 "no colon here", "Content-Length: 99"])))
        head = "\r\n".join(headers).encode("utf-8", "surrogatepass")
        parts.append(b"--" + boundary.encode("utf-8") + b"\r\n" + head + b"\r\n\r\n" + draw(_CONTENT) + b"\r\n")
    end = draw(st.sampled_from([b"--" + boundary.encode() + b"--\r\n", b"", b"--" + boundary.encode() + b"\r\n",
                                b"--" + boundary.encode() + b"--" + b"epilogue" * 10]))
    preamble = draw(st.sampled_from([b"", b"preamble\r\n", b"\r\n"]))
    quoted = draw(st.booleans())
    content_type = "multipart/form-data; boundary=" + (f'"{boundary}"' if quoted else boundary)
    return content_type, preamble + b"".join(parts) + end


@given(form=multipart(), path=st.sampled_from(["/v1/audio/voices", "/inference_vc", "/inference_zero_shot",
                                               "/inference_cross_lingual"]))
@example(form=("multipart/form-data; boundary=B", b'--B\r\nContent-Disposition: form-data; name="id"\r\n\r\n'
               b"alice\r\n--B\r\nContent-Disposition: form-data; name=\"audio\"; filename=\"../../x.wav\"\r\n\r\n"
               + WAV + b"\r\n--B--\r\n"), path="/v1/audio/voices")
@FUZZ
def test_hostile_multipart_uploads_are_answered_never_a_5xx(door, form, path):
    content_type, body = form
    try:
        content_type.encode("latin-1")
    except UnicodeEncodeError:
        content_type = content_type.encode("utf-8").decode("latin-1")  # the header's bytes as a client sends them
    raw = request("POST", path, body, {"authorization": AUTH, "content-type": content_type})
    assert_refusal_or_answer(*exchange(door, raw))


# ------------------------------------------------------------------------------------------- live frames (gRPC)

#: Codes that name a client's mistake; UNKNOWN, INTERNAL and UNAVAILABLE would be the gateway's own failure.
CLIENT_CODES = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
                grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAUTHENTICATED,
                grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNIMPLEMENTED}


def _piece(model: str, sequence_id, *, start: bool = False, end: bool = False) -> service_pb2.ModelInferRequest:
    """An innocent live piece: a little source audio (VC) or a word (TTS), the voice on the start."""
    req = _grpc_piece(sequence_id, start, end, model)
    if model == TTS_LIVE:
        del req.inputs[:], req.raw_input_contents[:]
        req.inputs.add(name="text", datatype="BYTES", shape=[1, 1]).contents.bytes_contents.append(b"word ")
    elif start:
        req.inputs.add(name="source_sample_rate", datatype="INT32", shape=[1, 1])
        req.raw_input_contents.append((16000).to_bytes(4, "little"))
    if start:
        req.inputs.add(name="speaker_id", datatype="BYTES", shape=[1, 1])
        if req.raw_input_contents:
            req.raw_input_contents.append(len(b"a").to_bytes(4, "little") + b"a")
        else:
            req.inputs[-1].contents.bytes_contents.append(b"a")
    return req


def live_stream(door: Door, requests, *, key: str = KEY, codes: bool = False):
    """The answers of one ``ModelStreamInfer`` stream at the gateway, its final code and details."""
    metadata = [("authorization", f"Bearer {key}")] + ([("triton_grpc_error", "true")] if codes else [])
    with grpc.insecure_channel(door.grpc) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        answers = []
        try:
            for a in stub.ModelStreamInfer(iter(requests), metadata=metadata, timeout=PATIENCE_S):
                answers.append(a)
        except grpc.RpcError as exc:
            return answers, exc.code(), exc.details()
        return answers, grpc.StatusCode.OK, ""


_DATATYPES = st.sampled_from(["FP32", "INT32", "INT64", "BYTES", "BOOL", "FP16", "UINT64", "INT8", "", "fp32",
                              "STRING", "\x00"])
_NAMES = st.one_of(st.sampled_from(["source_audio", "source_sample_rate", "prompt_audio", "prompt_sample_rate",
                                    "speaker_id", "seed", "text", "prompt_text", "mode", "prompt_audio_bytes"]),
                   _TEXT)
_SHAPES = st.lists(st.one_of(st.integers(-2, 6), st.sampled_from([2**31, 2**62, -(2**63)])), max_size=4)


@st.composite
def frame(draw, model: str) -> service_pb2.ModelInferRequest:
    """One live piece as a hostile client writes it."""
    req = service_pb2.ModelInferRequest(model_name=draw(st.sampled_from([model] * 6 + ["", "cosyvoice_vc",
                                                                                      "speakers", "x" * 300])))
    req.id = draw(st.sampled_from(["", "p", "x" * 200]))
    if req.model_version == "" and draw(st.integers(0, 9)) == 0:
        req.model_version = draw(st.sampled_from(["1", "-1", "x", "9" * 30]))
    for name in ("sequence_id", "sequence_start", "sequence_end"):
        kind = draw(st.sampled_from(["absent", "good", "good", "int64", "uint64", "string", "bool", "double"]))
        if kind == "absent":
            continue
        p = req.parameters[name]
        if kind == "good":
            kind = "int64" if name == "sequence_id" else "bool"
        if kind == "int64":
            p.int64_param = draw(st.sampled_from([1, 7, 0, -1, 2**63 - 1, -(2**63)]))
        elif kind == "uint64":
            p.uint64_param = draw(st.sampled_from([1, 7, 0, 2**64 - 1]))
        elif kind == "string":
            p.string_param = draw(st.one_of(st.sampled_from(["7", "", "s" * 300]), _TEXT.filter(
                lambda t: not any(0xD800 <= ord(c) <= 0xDFFF for c in t))))
        elif kind == "bool":
            p.bool_param = draw(st.booleans())
        else:
            p.double_param = draw(st.floats(allow_nan=True))
    if draw(st.integers(0, 5)) == 0:
        req.parameters[draw(_TOKEN)].string_param = draw(st.sampled_from(["x", "1", "y" * 500]))
    raw = draw(st.integers(0, 4)) == 0
    for _ in range(draw(st.integers(0, 4))):
        name = draw(_NAMES).encode("utf-8", "replace").decode()
        t = req.inputs.add(name=name, datatype=draw(_DATATYPES), shape=draw(_SHAPES))
        if raw:
            req.raw_input_contents.append(draw(st.binary(max_size=64)))
            continue
        which = draw(st.sampled_from(["fp32", "int", "int64", "bytes", "bool", "none"]))
        n = draw(st.integers(0, 6))
        if which == "fp32":
            t.contents.fp32_contents.extend(draw(st.lists(st.floats(width=32), min_size=n, max_size=n)))
        elif which == "int":
            t.contents.int_contents.extend(draw(st.lists(st.integers(-(2**31), 2**31 - 1), min_size=n, max_size=n)))
        elif which == "int64":
            t.contents.int64_contents.extend(draw(st.lists(st.integers(-(2**63), 2**63 - 1), min_size=n,
                                                           max_size=n)))
        elif which == "bytes":
            t.contents.bytes_contents.extend(draw(st.lists(st.binary(max_size=40), min_size=n, max_size=n)))
        elif which == "bool":
            t.contents.bool_contents.extend(draw(st.lists(st.booleans(), min_size=n, max_size=n)))
    if raw and draw(st.booleans()):
        req.raw_input_contents.append(b"\0" * 8)  # one more than inputs
    return req


def _assert_live_answers(answers, code, details, sent: int) -> None:
    assert code in CLIENT_CODES, (code, details)
    if code != grpc.StatusCode.OK:
        assert details and details.strip(), code
    for a in answers:
        assert isinstance(a.error_message, str)
    # each request gets its answer (the stand-in's one output), its refusal, or the stream ended early
    assert len([a for a in answers if a.error_message or a.infer_response.outputs]) <= sent


def _session(model: str):
    """Hostile frames alone, or inside an otherwise proper session."""
    frames = st.lists(frame(model), min_size=1, max_size=6)
    return st.tuples(st.just(model), st.one_of(frames, frames.map(
        lambda f: [_piece(model, 77, start=True), *f, _piece(model, 77, end=True)])))


#: a piece without a start, an end without a start, a start twice on one id
BROKEN = [_piece(VC_LIVE, 5), _piece(VC_LIVE, 6, end=True), _piece(VC_LIVE, 8, start=True),
          _piece(VC_LIVE, 8, start=True), _piece(VC_LIVE, 8, end=True)]


@given(case=st.sampled_from([VC_LIVE, TTS_LIVE]).flatmap(_session), codes=st.booleans())
@example(case=(VC_LIVE, BROKEN), codes=False)
@example(case=(VC_LIVE, BROKEN), codes=True)
@FUZZ
def test_live_frames_of_any_shape_end_with_a_clients_code(door, case, codes):
    _, frames = case
    answers, code, details = live_stream(door, frames, codes=codes)
    _assert_live_answers(answers, code, details, len(frames))


@given(req=st.sampled_from([VC_LIVE, TTS_LIVE, "cosyvoice_vc"]).flatmap(frame))
@FUZZ
def test_unary_frames_of_any_shape_end_with_a_clients_code(door, req):
    with grpc.insecure_channel(door.grpc) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        try:
            stub.ModelInfer(req, metadata=[("authorization", AUTH)], timeout=PATIENCE_S)
        except grpc.RpcError as exc:
            assert exc.code() in CLIENT_CODES, (exc.code(), exc.details())
            assert exc.details().strip()


@given(garbage=st.binary(min_size=1, max_size=300), stream=st.booleans())
@example(garbage=b"\xff\xff\xff\xff", stream=True)
@example(garbage=b"\x0a\x80", stream=False)
@FUZZ
def test_bytes_that_are_no_protobuf_are_invalid_argument(door, garbage, stream):
    """Bytes the method's message cannot be parsed from: INVALID_ARGUMENT; bytes that happen to parse: a request
    like any other (a client's code)."""
    method = "/inference.GRPCInferenceService/" + ("ModelStreamInfer" if stream else "ModelInfer")
    with grpc.insecure_channel(door.grpc) as channel:
        ident = lambda b: b
        metadata = [("authorization", AUTH)]
        try:
            if stream:
                list(channel.stream_stream(method, request_serializer=ident, response_deserializer=ident)(
                    iter([garbage]), metadata=metadata, timeout=PATIENCE_S))
            else:
                channel.unary_unary(method, request_serializer=ident, response_deserializer=ident)(
                    garbage, metadata=metadata, timeout=PATIENCE_S)
        except grpc.RpcError as exc:
            assert exc.code() in CLIENT_CODES, (exc.code(), exc.details())
            try:
                service_pb2.ModelInferRequest.FromString(garbage)
            except Exception:
                assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT, (exc.code(), exc.details())


def test_the_fuzzer_found_nothing_in_the_log(door):
    """The gateway logged no unexpected error during the runs before this one."""
    with contextlib.suppress(FileNotFoundError):
        text = door.log.read_text()
        assert "unexpected error" not in text and "Traceback" not in text, text[-5000:]
