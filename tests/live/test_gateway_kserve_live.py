"""Triton's own KServe API at the gateway (``/v2`` over HTTP, ``inference.GRPCInferenceService`` over gRPC), in
front of the session's real tritonserver (local flavor, tiny demo model), with Triton's own clients and no retries.

* the gateway's answer is Triton's own (bit-identical), JSON, binary and gRPC, streams included;
* the overflowing declared shape, sent again and again at the gateway over both protocols while two innocent
  clients convert speech, fails none of their requests and kills no stub (sent to Triton directly it kills one:
  ``test_hostile_server.py``);
* deep JSON, gzip, ambiguous framing, malformed JSON and a bad ``priority`` get 4xx from the gateway and never
  reach Triton, whose process and stubs stay the same;
* only the public models and APIs are served; the API key and the tenant's namespace hold on gRPC too."""

from __future__ import annotations

import contextlib
import gzip
import json
import queue
import socket
import threading
import urllib.error
import urllib.request

import numpy as np
import pytest
import soundfile as sf
from conftest import FIXTURES, PATIENCE_S, PATIENT_TEST_S, gateway_process, http_post, wait_until

tritonclient_http = pytest.importorskip("tritonclient.http")
tritonclient_grpc = pytest.importorskip("tritonclient.grpc")
from tritonclient.utils import InferenceServerException  # noqa: E402

pytestmark = pytest.mark.timeout(PATIENT_TEST_S)
KEY = "sk-kserve-test"
VOICE = "kserve_voice"
ROUNDS = 6  # each innocent client's requests during the attack


@pytest.fixture(scope="module")
def gateway(triton_server, tmp_path_factory):
    with gateway_process(triton_server, tmp_path_factory.mktemp("kserve") / "gateway.log",
                         "--max-body-bytes", "4000000") as urls:
        yield urls.http, urls.grpc


@pytest.fixture(scope="module")
def speech():
    src, ssr = sf.read(FIXTURES / "source_en_5s.wav", dtype="float32")
    prm, psr = sf.read(FIXTURES / "prompt_en_3s.wav", dtype="float32")
    return src[: int(1.5 * ssr)], ssr, prm[: int(1.2 * psr)], psr


def _inputs(mod, speech, binary=True):
    src, ssr, prm, psr = speech
    out = []
    for name, arr in (("source_audio", src[None]), ("source_sample_rate", np.array([[ssr]], np.int32)),
                      ("prompt_audio", prm[None]), ("prompt_sample_rate", np.array([[psr]], np.int32))):
        t = mod.InferInput(name, list(arr.shape), "FP32" if arr.dtype == np.float32 else "INT32")
        if mod is tritonclient_http:
            t.set_data_from_numpy(arr, binary_data=binary)
        else:
            t.set_data_from_numpy(arr)
        out.append(t)
    return out


def _client(protocol, url):
    if protocol == "grpc":
        return tritonclient_grpc, tritonclient_grpc.InferenceServerClient(url)
    return tritonclient_http, tritonclient_http.InferenceServerClient(url, connection_timeout=PATIENCE_S,
                                                                      network_timeout=PATIENCE_S)


def _convert(protocol, url, speech, binary=True, headers=None) -> np.ndarray:
    mod, client = _client(protocol, url)
    try:
        kw = {"client_timeout": PATIENCE_S} if protocol == "grpc" else {}
        return client.infer("cosyvoice_vc", _inputs(mod, speech, binary), headers=headers, **kw).as_numpy("waveform")
    finally:
        client.close()


@pytest.fixture(scope="module")
def reference(triton_server, speech):
    """Triton's own answer, asked directly."""
    return _convert("grpc", triton_server.grpc_url, speech)


def _stubs(server) -> set[tuple[str, int]]:
    return {(s.model, s.pid) for s in server.python_stubs() if s.alive}


@pytest.mark.parametrize("protocol,binary", [("http", False), ("http", True), ("grpc", True)])
def test_tritons_clients_get_tritons_own_answer_through_the_gateway(gateway, reference, speech, protocol, binary):
    url = gateway[0] if protocol == "http" else gateway[1]
    np.testing.assert_array_equal(_convert(protocol, url, speech, binary), reference)
    _, client = _client(protocol, url)
    try:
        assert client.is_server_live() and client.is_server_ready() and client.is_model_ready("cosyvoice_vc")
        meta = client.get_model_metadata("cosyvoice_vc")
        names = [i["name"] for i in meta["inputs"]] if protocol == "http" else [i.name for i in meta.inputs]
        assert "source_audio" in names
    finally:
        client.close()


def _overflow_http(url: str) -> tuple[int, bytes]:
    """The declared shape whose FP32 byte size overflows to 0 (``4 * 2**62 == 2**64``), with 0 bytes of data."""
    header = json.dumps({"inputs": [
        {"name": "source_audio", "shape": [1, 2**62], "datatype": "FP32", "parameters": {"binary_data_size": 0}},
        {"name": "source_sample_rate", "shape": [1, 1], "datatype": "INT32", "data": [16000]},
        {"name": "prompt_audio", "shape": [1, 4], "datatype": "FP32", "data": [0.0] * 4},
        {"name": "prompt_sample_rate", "shape": [1, 1], "datatype": "INT32", "data": [16000]}]}).encode()
    return http_post(url, "/v2/models/cosyvoice_vc/infer", header,
                 {"Inference-Header-Content-Length": str(len(header)), "Content-Type": "application/octet-stream"})


def _overflow_grpc(url: str):
    import grpc
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    request = service_pb2.ModelInferRequest(model_name="cosyvoice_vc")
    for name, shape in (("source_audio", [1, 2**62]), ("prompt_audio", [1, 16000])):
        request.inputs.add(name=name, datatype="FP32", shape=shape)
    for name in ("source_sample_rate", "prompt_sample_rate"):
        request.inputs.add(name=name, datatype="INT32", shape=[1, 1])
    request.raw_input_contents.extend([b"", np.zeros(16000, np.float32).tobytes(), np.int32(16000).tobytes(),
                                       np.int32(16000).tobytes()])
    with grpc.insecure_channel(url) as channel:
        try:
            service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=PATIENCE_S)
        except grpc.RpcError as exc:
            return exc.code(), exc.details()
    return None, "answered"


def test_the_repeated_overflow_attack_fails_no_innocent_request(triton_server, gateway, reference, speech):
    import grpc

    http_url, grpc_url = gateway
    before = _stubs(triton_server)
    stop, attacks, innocents = threading.Event(), queue.Queue(), queue.Queue()

    def attacker():
        while not stop.is_set():
            attacks.put(("http", *_overflow_http(http_url)))
            attacks.put(("grpc", *_overflow_grpc(grpc_url)))
            stop.wait(0.1)

    def innocent(protocol):
        url = http_url if protocol == "http" else grpc_url
        for _ in range(ROUNDS):
            try:
                innocents.put((protocol, _convert(protocol, url, speech)))
            except Exception as exc:  # no retries: any failure counts
                innocents.put((protocol, exc))

    threads = [threading.Thread(target=innocent, args=(p,)) for p in ("http", "grpc")]
    hostile = threading.Thread(target=attacker)
    hostile.start()
    wait_until(lambda: attacks.qsize() >= 2, "the first attacks answered")
    for t in threads:
        t.start()
    for t in threads:
        t.join(PATIENT_TEST_S)
    stop.set()
    hostile.join(PATIENCE_S)
    got = [innocents.get() for _ in range(innocents.qsize())]
    failed = [(p, r) for p, r in got if not isinstance(r, np.ndarray) or not np.array_equal(r, reference)]
    assert len(got) == 2 * ROUNDS and not failed, failed[:3]
    answers = [attacks.get() for _ in range(attacks.qsize())]
    assert len(answers) >= 4
    for protocol, status, message in answers:
        if protocol == "http":
            assert status == 400 and b"source_audio" in message, (status, message[:300])
        else:
            assert status == grpc.StatusCode.INVALID_ARGUMENT and "source_audio" in message, (status, message)
    assert _stubs(triton_server) == before, "a stub died or was replaced"
    assert triton_server.is_ready()
    print(f"\noverflow attack at the gateway: {len(answers)} attacks refused, {len(got)} innocent requests, "
          f"{len(failed)} failed")


def _raw_http(url: str, data: bytes) -> bytes:
    host, port = url.split(":")
    with socket.create_connection((host, int(port)), timeout=PATIENCE_S) as s:
        s.sendall(data)
        chunks = []
        while True:
            chunk = s.recv(65536)
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)


def test_deep_json_gzip_smuggling_and_bad_values_get_4xx_and_never_reach_triton(triton_server, gateway, reference,
                                                                                 speech):
    http_url = gateway[0]
    pid, before = triton_server.process.pid, _stubs(triton_server)
    path = "/v2/models/cosyvoice_vc/infer"
    deep = (b'{"inputs":[{"name":"source_audio","shape":[1,1],"datatype":"FP32","data":' + b"[" * 100_000
            + b"]" * 100_000 + b"}]}")
    status, answer = http_post(http_url, path, deep, {"Content-Type": "application/json"})
    assert status == 400 and b"nested" in answer, (status, answer[:200])
    assert json.loads(answer)["error"].startswith("the JSON body is nested")  # KServe's error shape
    packed = gzip.compress(b'{"inputs":[{"name":"x","shape":[1],"datatype":"FP32","data":[' + b" " * (50 << 20)
                           + b"1]}]}")
    status, answer = http_post(http_url, path, packed, {"Content-Type": "application/json", "Content-Encoding": "gzip"})
    assert status == 415, (status, answer[:200])
    for body in (b'{"inputs": [', b"\xff\xfe", b'{"inputs":[{"name":"source_audio","shape":[1,1],"datatype":"FP32",'
                 b'"data":[1,]}]}'):
        status, answer = http_post(http_url, path, body, {"Content-Type": "application/json"})
        assert status == 400 and b"not valid JSON" in answer, (body, status, answer[:200])
    for priority in (-1, "abc", 1.5, 2**70):  # Triton's own parser answers these with HTTP 500
        body = json.dumps({"parameters": {"priority": priority}, "inputs": []}).encode()
        status, answer = http_post(http_url, path, body, {"Content-Type": "application/json"})
        assert status == 400 and b"priority" in answer, (priority, status, answer[:200])
    smuggled = (b"POST " + path.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\n"
                b"Transfer-Encoding: chunked\r\nContent-Type: application/json\r\n\r\n0\r\n\r\n"
                b"GET /v2/repository/index HTTP/1.1\r\nHost: x\r\n\r\n")
    answer = _raw_http(http_url, smuggled)
    assert answer.startswith(b"HTTP/1.1 400") and answer.count(b"HTTP/1.1") == 1, answer[:300]
    assert triton_server.process.pid == pid and _stubs(triton_server) == before
    np.testing.assert_array_equal(_convert("http", http_url, speech), reference)


def test_only_public_models_and_apis_are_served(gateway):
    http_url, grpc_url = gateway
    for model in ("hift", "speakers", "flow_estimator"):
        status, answer = http_post(http_url, f"/v2/models/{model}/infer", b'{"inputs": []}',
                               {"Content-Type": "application/json"})
        assert status == 404 and b"not served at this entry point" in answer, (model, status, answer[:200])
        client = tritonclient_grpc.InferenceServerClient(grpc_url)
        try:
            with pytest.raises(InferenceServerException, match="not served at this entry point"):
                client.get_model_metadata(model)
        finally:
            client.close()
    for path in ("/v2/systemsharedmemory/status", "/v2/repository/index", "/v2/models/cosyvoice_vc/config",
                 "/v2/models/stats", "/v2/logging"):
        with contextlib.suppress(urllib.error.HTTPError):
            urllib.request.urlopen(f"http://{http_url}{path}", timeout=PATIENCE_S)
            pytest.fail(f"{path} was served")
    client = tritonclient_grpc.InferenceServerClient(grpc_url)
    try:
        for call in (client.get_system_shared_memory_status, client.get_model_repository_index,
                     lambda: client.get_model_config("cosyvoice_vc"), client.get_log_settings):
            with pytest.raises(InferenceServerException, match="(?i)unimplemented"):
                call()
    finally:
        client.close()


def _stream(url, speech, requests, headers=None):
    """``(chunks, errors)`` of one gRPC stream through ``url``: each of ``requests`` (a dict of arrays) sent."""
    results: queue.Queue = queue.Queue()
    client = tritonclient_grpc.InferenceServerClient(url)
    try:
        client.start_stream(callback=lambda result, error: results.put((result, error)), headers=headers)
        for tensors in requests:
            inputs = []
            for name, arr in tensors.items():
                t = tritonclient_grpc.InferInput(name, list(arr.shape), {np.dtype(np.float32): "FP32",
                                                                        np.dtype(np.int32): "INT32",
                                                                        np.dtype(object): "BYTES"}[arr.dtype])
                t.set_data_from_numpy(arr)
                inputs.append(t)
            client.async_stream_infer("cosyvoice_vc_stream", inputs, enable_empty_final_response=True)
        chunks, errors, finals = [], [], 0
        while finals < len(requests):
            result, error = results.get(timeout=PATIENCE_S)
            if error is not None:
                errors.append(str(error))
                finals += 1
                continue
            if result.get_response().parameters.get("triton_final_response").bool_param:
                finals += 1
            if result.as_numpy("waveform") is not None and result.as_numpy("waveform").size:
                chunks.append(result.as_numpy("waveform"))
        return chunks, errors
    finally:
        client.stop_stream()
        client.close()


def _vc_stream_inputs(speech, **override):
    src, ssr, prm, psr = speech
    base = {"source_audio": src[None], "source_sample_rate": np.array([[ssr]], np.int32),
            "prompt_audio": prm[None], "prompt_sample_rate": np.array([[psr]], np.int32)}
    base.update(override)
    return {k: v for k, v in base.items() if v is not None}


def test_a_bad_request_in_a_grpc_stream_is_answered_in_the_stream_and_the_good_one_streams(gateway, speech):
    bad = _vc_stream_inputs(speech, source_audio=np.zeros((1, 3, 4), np.float32))
    chunks, errors = _stream(gateway[1], speech, [bad, _vc_stream_inputs(speech)])
    assert len(errors) == 1 and "source_audio" in errors[0] and "dims" in errors[0], errors
    assert chunks and sum(c.size for c in chunks) > 0


def test_the_key_and_the_tenants_namespace_hold_on_grpc(triton_server, speech, tmp_path):
    from cosyvoice_triton.clients.client import VCClient
    from cosyvoice_triton.gateway.tenants import Namespace, key_tenant

    scoped = Namespace(key_tenant(KEY)).scoped(VOICE)
    with VCClient(triton_server.grpc_url, protocol="grpc", timeout=PATIENCE_S) as c, \
            gateway_process(triton_server, tmp_path / "keyed.log", "--api-key", KEY) as urls:
        grpc_url = urls.grpc
        c.register_speaker(scoped, str(FIXTURES / "prompt_en_3s.wav"))
        try:
            client = tritonclient_grpc.InferenceServerClient(grpc_url)
            try:
                with pytest.raises(InferenceServerException, match="(?i)unauthenticated|api key"):
                    client.is_server_ready()
                assert client.is_server_ready(headers={"authorization": f"Bearer {KEY}"})
            finally:
                client.close()
            by_voice = _vc_stream_inputs(speech, prompt_audio=None, prompt_sample_rate=None,
                                         speaker_id=np.array([[VOICE.encode()]], object))
            chunks, errors = _stream(grpc_url, speech, [by_voice], headers={"authorization": f"Bearer {KEY}"})
            assert not errors and chunks, errors
            # another tenant's id is not reachable by its scoped name
            other = dict(by_voice, speaker_id=np.array([[scoped.encode()]], object))
            chunks, errors = _stream(grpc_url, speech, [other], headers={"authorization": f"Bearer {KEY}"})
            assert errors and not chunks
        finally:
            c.delete_speaker(scoped)
