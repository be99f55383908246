"""The KServe entry points' checks in process (no server): what :mod:`cosyvoice_triton.gateway.inference` lets
through to Triton and what it refuses, for the HTTP body (JSON and the binary extension) and the gRPC request,
each refusal a 400 naming the input. The same requests against a live Triton: ``test_gateway_kserve_live.py``."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from cosyvoice_triton.gateway.errors import GatewayError
from cosyvoice_triton.gateway.inference import Signature, bytes_elements, check_parameters, encode_bytes
from cosyvoice_triton.gateway.kserve_http import HEADER_LENGTH, checked_body
from cosyvoice_triton.gateway.tenants import PUBLIC, Namespace

SIG = Signature.from_metadata({
    "name": "cosyvoice_vc_stream",
    "inputs": [{"name": "source_audio", "datatype": "FP32", "shape": ["-1", "-1"]},
               {"name": "source_sample_rate", "datatype": "INT32", "shape": ["-1", "1"]},
               {"name": "speaker_id", "datatype": "BYTES", "shape": ["-1", "1"]}],
    "outputs": [{"name": "waveform", "datatype": "FP32", "shape": ["-1", "-1"]}]})
AUDIO = [0.0, 0.5, -0.25, 1.0]


def _json(inputs, **extra) -> bytes:
    return json.dumps({"inputs": inputs, **extra}).encode()


def _good(**override):
    inputs = {"source_audio": {"name": "source_audio", "shape": [1, 4], "datatype": "FP32", "data": AUDIO},
              "source_sample_rate": {"name": "source_sample_rate", "shape": [1, 1], "datatype": "INT32",
                                     "data": [16000]}}
    for name, entry in override.items():
        if entry is None:
            inputs.pop(name)
        else:
            inputs[name] = {**inputs.get(name, {"name": name}), **entry}
    return list(inputs.values())


def _refused(body: bytes, *words: str, header_length: str | None = None, ns: Namespace = PUBLIC):
    with pytest.raises(GatewayError) as exc:
        checked_body(SIG, body, header_length, ns, 16)
    assert exc.value.status == 400, exc.value.message
    for w in words:
        assert w in exc.value.message, (w, exc.value.message)
    return exc.value


def test_a_good_json_request_passes_re_encoded():
    out, headers = checked_body(SIG, _json(_good(), id="r1", parameters={"priority": 1}), None, PUBLIC, 16)
    assert headers == {"content-type": "application/json"}
    sent = json.loads(out)
    assert sent["id"] == "r1" and sent["parameters"] == {"priority": 1}
    assert sent["inputs"][0]["data"] == AUDIO and sent["inputs"][1]["data"] == [16000]


def test_nested_row_major_data_is_accepted_and_sent_flat():
    nested = _good(source_audio={"shape": [2, 2], "data": [[0.0, 0.5], [-0.25, 1.0]]})
    sent = json.loads(checked_body(SIG, _json(nested), None, PUBLIC, 16)[0])
    assert sent["inputs"][0]["data"] == AUDIO


@pytest.mark.parametrize("shape", [[1, 2**60], [1, 2**62], [2**32, 2**32], [1, -1], [1, 1.5], [1, True], [1, "4"]])
def test_a_shape_that_does_not_match_its_data_is_refused(shape):
    """The overflow attack (``2**62`` FP32 elements are 0 bytes modulo 2**64) and its kin never reach Triton."""
    _refused(_json(_good(source_audio={"shape": shape})), "source_audio")


@pytest.mark.parametrize("shape,words", [([1, 2**62], ["dim 1"]), ([2**20, 2**20], ["4398046511104 bytes"])])
def test_the_overflowing_shape_with_binary_data_is_refused(shape, words):
    inputs = _good(source_audio={"shape": shape, "parameters": {"binary_data_size": 0}})
    del inputs[0]["data"]
    head = _json(inputs)
    _refused(head, "source_audio", *words, header_length=str(len(head)))


def test_binary_data_passes_exactly_and_leftover_bytes_are_refused():
    audio = np.asarray(AUDIO, np.float32).tobytes()
    inputs = _good(source_audio={"parameters": {"binary_data_size": len(audio)}})
    del inputs[0]["data"]
    head = _json(inputs)
    out, headers = checked_body(SIG, head + audio, str(len(head)), PUBLIC, 16)
    split = int(headers[HEADER_LENGTH])
    assert out[split:] == audio and json.loads(out[:split])["inputs"][0]["parameters"] == {"binary_data_size": 16}
    _refused(head + audio + b"xx", "2 bytes", header_length=str(len(head)))
    _refused(head + audio[:-1], "binary_data_size", header_length=str(len(head)))
    _refused(head + audio, "Inference-Header-Content-Length", header_length="999999")


@pytest.mark.parametrize("override,words", [
    ({"source_audio": {"datatype": "FP64"}}, ["source_audio", "FP64", "FP32"]),
    ({"source_audio": {"shape": [1, 2, 2]}}, ["source_audio", "3 dims"]),
    ({"source_sample_rate": {"shape": [1, 2], "data": [1, 2]}}, ["source_sample_rate", "dim 1", "declares 1"]),
    ({"source_audio": {"data": AUDIO[:3]}}, ["source_audio", "4 elements", "has 3"]),
    ({"source_audio": {"data": [0.0, 1e39, 0.0, 0.0]}}, ["source_audio", "finite"]),
    ({"source_audio": {"data": [0.0, "a", 0.0, 0.0]}}, ["source_audio", "finite"]),
    ({"source_audio": {"data": [[[0.0, 0.5, -0.25, 1.0]]]}}, ["source_audio", "nested deeper"]),
    ({"source_sample_rate": {"data": [2**32 + 16000]}}, ["source_sample_rate", "INT32"]),
    ({"source_sample_rate": {"data": [True]}}, ["source_sample_rate", "INT32"]),
    ({"prompt_mel": {"shape": [1], "datatype": "FP32", "data": [0.0]}}, ["no input 'prompt_mel'"]),
    ({"source_audio": {"parameters": {"shared_memory_region": "stolen"}}}, ["shared memory"]),
    ({"source_audio": {"extra": 1}}, ["unknown field"]),
])
def test_each_bad_input_is_refused_naming_it(override, words):
    _refused(_json(_good(**override)), *words)


@pytest.mark.parametrize("value", [b"NaN", b"Infinity", b"1e999", b"1" * 400])
def test_non_finite_or_huge_json_numbers_are_refused(value):
    body = _json(_good()).replace(b"0.5", value)
    _refused(body, "source_audio", "finite")


def test_a_lone_surrogate_in_bytes_data_is_refused():
    """JSON may escape a lone surrogate (``"\\ud800"``), which no UTF-8 encoder takes: the client's input, refused
    naming the input (more in ``test_gateway_text.py``)."""
    sig = Signature.from_metadata({"name": "cosyvoice_tts", "inputs": [
        {"name": "text", "datatype": "BYTES", "shape": ["-1", "1"]}], "outputs": []})
    body = b'{"inputs": [{"name": "text", "shape": [1, 1], "datatype": "BYTES", "data": ["hi \\ud800"]}]}'
    with pytest.raises(GatewayError, match="'text'.*surrogate"):
        checked_body(sig, body, None, PUBLIC, 16)
    bad = _json(_good(speaker_id={"shape": [1, 1], "datatype": "BYTES", "data": ["x"]})).replace(b'"x"', b'"\\ud800"')
    _refused(bad, "speaker_id")


def test_an_input_given_twice_is_refused():
    inputs = _good()
    _refused(_json([*inputs, inputs[0]]), "given twice")


@pytest.mark.parametrize("params,words", [
    ({"priority": -1}, ["priority", "0.."]), ({"priority": "abc"}, ["priority"]), ({"priority": 1.5}, ["priority"]),
    ({"priority": 2**70}, ["priority"]), ({"timeout": -5}, ["timeout"]), ({"sequence_start": 1}, ["true or false"]),
    ({"x" * 65: 1}, ["name"]), ({"seed": "y" * 300}, ["300 characters"]), ({"seed": [1]}, ["seed"]),
])
def test_bad_request_parameters_are_refused(params, words):
    """Triton's own parser answers a bad ``priority`` with HTTP 500; here it is a 400 naming it."""
    _refused(_json(_good(), parameters=params), *words)
    with pytest.raises(GatewayError):
        check_parameters(params)


@pytest.mark.parametrize("body,words", [
    (b'{"inputs": [', ["not valid JSON"]), (b"\xff\xfe", ["not valid JSON"]), (b"[1, 2]", ["object"]),
    (b'{"inputs": 5}', ["inputs", "list"]), (b'{"inputs": [], "x": 1}', ["unknown field"]),
    (b'{"inputs":[{"name":"source_audio","shape":[1,1],"datatype":"FP32","data":[1,]}]}', ["not valid JSON"]),
    (b'{"inputs":[{"name":"source_audio","shape":[1,1],"datatype":"FP32","data":' + b"[" * 10_000 + b"]" * 10_000
     + b"}]}", ["nested 10003 deep"]),
])
def test_malformed_or_deep_json_is_a_400(body, words):
    _refused(body, *words)


def test_a_speaker_id_goes_to_the_callers_namespace():
    ns = Namespace("acme")
    body = _json(_good(speaker_id={"shape": [1, 1], "datatype": "BYTES", "data": ["alice"]}))
    sent = json.loads(checked_body(SIG, body, None, ns, 16)[0])
    assert sent["inputs"][-1]["data"] == ["t-acme.alice"]
    # the public namespace cannot name a tenant's voice
    reserved = _json(_good(speaker_id={"shape": [1, 1], "datatype": "BYTES", "data": ["t-acme.alice"]}))
    _refused(reserved, "speaker_id", "reserved")
    raw = encode_bytes([b"bob"])
    inputs = _good(speaker_id={"shape": [1, 1], "datatype": "BYTES", "parameters": {"binary_data_size": len(raw)}})
    head = _json(inputs)
    out, headers = checked_body(SIG, head + raw, str(len(head)), ns, 16)
    assert bytes_elements(out[int(headers[HEADER_LENGTH]):], "speaker_id") == [b"t-acme.bob"]


def test_binary_bytes_elements_must_frame_exactly():
    assert bytes_elements(encode_bytes([b"a", b"", b"bc"]), "x") == [b"a", b"", b"bc"]
    for raw in (b"\x01\x00", struct.pack("<I", 10) + b"abc"):
        with pytest.raises(GatewayError, match="'x'"):
            bytes_elements(raw, "x")


# ------------------------------------------------------------------------------ gRPC
def _grpc_request(shape=(1, 4), raw=True, model_name="cosyvoice_vc_stream"):
    from tritonclient.grpc import service_pb2

    req = service_pb2.ModelInferRequest(model_name=model_name)
    req.inputs.add(name="source_audio", datatype="FP32", shape=list(shape))
    req.inputs.add(name="source_sample_rate", datatype="INT32", shape=[1, 1])
    if raw:
        req.raw_input_contents.extend([np.asarray(AUDIO, np.float32).tobytes(), np.int32(16000).tobytes()])
    else:
        req.inputs[0].contents.fp32_contents.extend(AUDIO)
        req.inputs[1].contents.int_contents.append(16000)
    return req


class _Upstream:
    models = frozenset({"cosyvoice_vc_stream"})

    def public(self, model):
        if model not in self.models:
            raise GatewayError(404, f"model {model!r} is not served at this entry point")
        return model


def _grpc_refused(req, *words, status=400):
    from cosyvoice_triton.gateway.kserve_grpc import checked_request

    with pytest.raises(GatewayError) as exc:
        checked_request(_Upstream(), SIG, req, PUBLIC)
    assert exc.value.status == status, exc.value.message
    for w in words:
        assert w in exc.value.message, (w, exc.value.message)


def test_grpc_good_requests_pass_unchanged():
    from cosyvoice_triton.gateway.kserve_grpc import checked_request

    for raw in (True, False):
        req = _grpc_request(raw=raw)
        assert checked_request(_Upstream(), SIG, req, PUBLIC) == req


def test_grpc_overflowing_shape_and_mismatches_are_refused():
    _grpc_refused(_grpc_request(shape=(1, 2**62)), "source_audio")
    _grpc_refused(_grpc_request(shape=(1, -4)), "source_audio", "dim 1")
    _grpc_refused(_grpc_request(shape=(1, 5), raw=False), "source_audio", "5 elements")
    req = _grpc_request()
    del req.raw_input_contents[1]
    _grpc_refused(req, "raw_input_contents")
    req = _grpc_request(raw=False)
    req.inputs[1].contents.fp32_contents.append(1.0)
    _grpc_refused(req, "source_sample_rate", "int_contents")
    req = _grpc_request(model_name="hift")
    _grpc_refused(req, "hift", status=404)


def test_grpc_parameters_and_shared_memory_are_checked():
    req = _grpc_request()
    req.parameters["priority"].int64_param = -1
    _grpc_refused(req, "priority")
    req = _grpc_request()
    req.inputs[0].parameters["shared_memory_region"].string_param = "stolen"
    _grpc_refused(req, "shared memory")


def test_grpc_speaker_id_is_scoped():
    from cosyvoice_triton.gateway.kserve_grpc import checked_request

    for raw in (True, False):
        req = _grpc_request(raw=raw)
        t = req.inputs.add(name="speaker_id", datatype="BYTES", shape=[1, 1])
        if raw:
            req.raw_input_contents.append(encode_bytes([b"alice"]))
        else:
            t.contents.bytes_contents.append(b"alice")
        out = checked_request(_Upstream(), SIG, req, Namespace("acme"))
        got = (bytes_elements(out.raw_input_contents[2], "speaker_id") if raw
               else list(out.inputs[2].contents.bytes_contents))
        assert got == [b"t-acme.alice"]
        assert list(req.inputs[2].contents.bytes_contents or [b"alice"]) == [b"alice"]  # the client's is untouched
