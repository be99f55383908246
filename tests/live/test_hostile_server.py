"""Hostile requests against a live, supervised ``tritonserver`` (local flavor, tiny demo model, 127.0.0.1 only).

What Triton 2.51 itself cannot survive, and what the launcher does about it
(``cosyvoice_triton.serving.launch.supervisor``):

* a binary input whose declared shape overflows the byte size (``[1, 80, 2**60]`` FP32 with 0 bytes) kills the
  model's Python stub (HTTP and gRPC): the supervisor unloads the model (readiness goes false) and loads it again;
* a JSON body nested 100,000 levels deep kills the server (SIGSEGV): the supervisor starts it again, same ports;
* the administrative APIs (shared memory, repository, model config, statistics, trace, logging) need the admin
  header on both protocols, so a client can no longer register a stub's shared memory to read other requests.

Malformed JSON still gets HTTP 500 (Triton's HTTP frontend; the README says what a proxy in front must do).
Every hostile request is sent a bounded number of times with a timeout; the whole module takes about a minute on
an idle machine (each wait on a recovery gives up only after ``COSYVOICE_TEST_PATIENCE`` s).
"""

from __future__ import annotations

import gzip
import http.client
import json
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from conftest import FIXTURES, PATIENCE_S, PATIENT_TEST_S, PROBE_TIMEOUT_S, http_post, wait_until

from cosyvoice_triton.serving.launch.server import (
    RESTRICTED_APIS,
    TritonInstallation,
    TritonNotInstalled,
    TritonServer,
    find_installation,
)
from cosyvoice_triton.serving.launch.supervisor import Supervisor

tritonclient_http = pytest.importorskip("tritonclient.http", reason="pip install 'tritonclient[http,grpc]==2.51.0'")
tritonclient_grpc = pytest.importorskip("tritonclient.grpc", reason="pip install 'tritonclient[http,grpc]==2.51.0'")

pytestmark = pytest.mark.timeout(PATIENT_TEST_S)
OVERFLOW_2_60 = 2**60  # 80 * 4 bytes * 2**60 == 0 mod 2**64
OVERFLOW_2_62 = 2**62  # 4 bytes * 2**62 == 0 mod 2**64
FIGURES: dict[str, float | str] = {}


@pytest.fixture(scope="module")
def supervised(serving_assets, tmp_path_factory):
    from cosyvoice_triton.serving.repository import render_repository

    try:
        find_installation()
    except TritonNotInstalled as exc:
        pytest.skip(str(exc))
    root = tmp_path_factory.mktemp("hostile")
    repo = root / "model_repository"
    render_repository("local", repo, model_dir=serving_assets["model_dir"], onnx_dir=serving_assets["onnx_dir"],
                      max_queue_delay_us=2000)
    server = TritonServer(repo, work_dir=root / "triton", exit_timeout=5, model_control="explicit",
                          load_models=["*"], probe_timeout=PROBE_TIMEOUT_S)
    sup = Supervisor(server, interval=0.25, backoff=0.5, max_backoff=2.0, max_restarts=3, restart_window=300.0,
                     start_timeout=PATIENCE_S, unload_timeout=PATIENCE_S)
    with sup:
        yield sup
    print("\nhostile-input figures:", json.dumps(FIGURES, indent=1))
    print("supervisor events:", [(e.kind, e.detail.splitlines()[0][:80], round(e.seconds, 2)) for e in sup.events])


@pytest.fixture(scope="module")
def speech():
    src, ssr = sf.read(FIXTURES / "source_en_5s.wav", dtype="float32")
    prm, psr = sf.read(FIXTURES / "prompt_en_3s.wav", dtype="float32")
    return src[: int(1.5 * ssr)], ssr, prm[: int(1.5 * psr)], psr


def _binary_infer(server: TritonServer, model: str, inputs: list[dict], data: bytes = b"") -> tuple[int, bytes]:
    """A hand-framed HTTP binary-data request: JSON header, then the raw tensor bytes."""
    header = json.dumps({"inputs": inputs}).encode()
    return http_post(server.http_url, f"/v2/models/{model}/infer", header + data,
                 {"Inference-Header-Content-Length": str(len(header)), "Content-Type": "application/octet-stream"})


def _hift_ok(server: TritonServer) -> bool:
    mel = np.zeros((1, 80, 20), np.float32)
    try:
        status, _ = _binary_infer(server, "hift", [{"name": "mel", "shape": [1, 80, 20], "datatype": "FP32",
                                                     "parameters": {"binary_data_size": mel.nbytes}}], mel.tobytes())
    except OSError:
        return False
    return status == 200


def _vc_ok(server: TritonServer, speech) -> bool:
    from cosyvoice_triton.clients.client import VCClient, VCError

    src, ssr, prm, psr = speech
    try:
        with VCClient(server.grpc_url, protocol="grpc", timeout=PATIENCE_S) as c:
            return c.convert(src, prm, source_sr=ssr, prompt_sr=psr, seed=1).seconds > 0
    except (VCError, OSError):
        return False


class ReadinessWatch:
    """Polls ``/v2/health/ready`` every 20 ms from a thread while an attack and the recovery run (the attack's own
    answer may come only after the supervisor has already swapped the dead stage for a new one)."""

    def __init__(self, server: TritonServer):
        self.server, self.samples = server, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.monotonic(), self.server.is_ready()))
            time.sleep(0.02)

    def __enter__(self) -> ReadinessWatch:
        self.t0 = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=PROBE_TIMEOUT_S + 10)

    def first_unready(self) -> float | None:
        return next((t - self.t0 for t, ok in self.samples if not ok), None)


def _recover(sup: Supervisor, watch: ReadinessWatch, probe, name: str) -> None:
    """After a kill: readiness must have gone false (or the server been down), then a valid request must succeed,
    without anyone's help (the ceiling: PATIENCE_S, a busy machine's); records the seconds in FIGURES."""
    server = sup.server
    while time.monotonic() - watch.t0 < PATIENCE_S:
        if watch.first_unready() is not None and server.is_ready() and probe():
            FIGURES[f"{name}: not ready after (s)"] = round(watch.first_unready(), 2)
            FIGURES[f"{name}: serving again after (s)"] = round(time.monotonic() - watch.t0, 2)
            return
        time.sleep(0.1)
    assert watch.first_unready() is not None, f"{name}: the server kept answering ready although a stage was dead"
    pytest.fail(f"{name}: not serving {PATIENCE_S:.0f} s later (COSYVOICE_TEST_PATIENCE); supervisor events: "
                f"{sup.events}\n{server.log_text()[-3000:]}")


# ------------------------------------------------------------------------------ restricted APIs (finding 7)
HTTP_RESTRICTED = [("GET", "/v2/systemsharedmemory/status"), ("GET", "/v2/cudasharedmemory/status"),
                   ("POST", "/v2/repository/index"), ("POST", "/v2/repository/models/hift/unload"),
                   ("GET", "/v2/models/hift/config"), ("GET", "/v2/models/stats"), ("GET", "/v2/trace/setting"),
                   ("GET", "/v2/logging")]


def test_http_admin_apis_are_refused_without_the_admin_header(supervised):
    server = supervised.server
    for method, path in HTTP_RESTRICTED:
        status, body = server.request(method, path, body=b"" if method == "POST" else None)
        assert status == 403 and b"restricted" in body, (method, path, status, body)
    wrong = {"cosyvoice-admin-key": "0" * 48}
    assert http_post(server.http_url, "/v2/repository/index", b"", wrong)[0] == 403
    for method, path in HTTP_RESTRICTED:
        if "unload" not in path:
            assert server.request(method, path, body=b"" if method == "POST" else None, admin=True)[0] == 200, path
    assert server.request("GET", "/v2/models/hift")[0] == 200  # metadata stays open
    assert server.request("GET", "/v2/health/ready")[0] == 200


def test_grpc_admin_apis_are_refused_without_the_admin_header(supervised):
    from tritonclient.utils import InferenceServerException

    server = supervised.server
    client = tritonclient_grpc.InferenceServerClient(server.grpc_url)
    calls = {"shared-memory": lambda **k: client.get_system_shared_memory_status(**k),
             "model-repository": lambda **k: client.get_model_repository_index(**k),
             "model-config": lambda **k: client.get_model_config("hift", **k),
             "statistics": lambda **k: client.get_inference_statistics(**k),
             "logging": lambda **k: client.get_log_settings(**k),
             "trace": lambda **k: client.get_trace_settings(**k)}
    try:
        for _name, call in calls.items():
            for headers in (None, {"triton-grpc-protocol-cosyvoice-admin-key": "0" * 48}):
                with pytest.raises(InferenceServerException, match="restricted"):
                    call(headers=headers)
            call(headers=server.admin_headers("grpc"))  # the key opens it
        assert client.get_model_metadata("hift").name == "hift"
    finally:
        client.close()


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_registering_a_stubs_shared_memory_is_refused(supervised, protocol):
    """The attack of the issue: register a Python stub's own shm region as a client region, then read it back."""
    from tritonclient.utils import InferenceServerException

    server = supervised.server
    regions = []
    for stub in server.python_stubs():
        argv = Path(f"/proc/{stub.pid}/cmdline").read_bytes().split(b"\0")
        if len(argv) > 2 and argv[2].startswith(b"triton_python_backend_shm_region"):
            regions.append(argv[2].decode())
    assert regions, "no stub shared-memory region found to attack"
    module = tritonclient_http if protocol == "http" else tritonclient_grpc
    client = module.InferenceServerClient(server.http_url if protocol == "http" else server.grpc_url)
    try:
        with pytest.raises(InferenceServerException, match="restricted"):
            client.register_system_shared_memory("stolen", "/" + regions[0], 1 << 20)
        status = client.get_system_shared_memory_status(headers=server.admin_headers(protocol))
        registered = status if protocol == "http" else list(status.regions)
        assert not registered, f"a region got registered: {registered}"
    finally:
        client.close()


# ------------------------------------------------------------------------------ malformed JSON, gzip (finding 8)
def test_malformed_json_is_an_error_and_the_server_survives(supervised):
    server = supervised.server
    bodies = [b'{"inputs": [', b"{", b"[1,2", b'{"inputs": 5}', b"\xff\xfe",
              b'{"inputs":[{"name":"mel","shape":[1,80,1],"datatype":"FP32","data":[1,]}]}']
    for body in bodies:
        status, answer = http_post(server.http_url, "/v2/models/hift/infer", body, {"Content-Type": "application/json"})
        # Triton 2.51's HTTP frontend answers 500 to a body it cannot parse (README: a proxy in front maps it)
        assert status in (400, 500) and b"error" in answer, (body, status, answer)
    assert server.is_ready() and _hift_ok(server)


def test_gzip_body_is_inflated_by_triton_without_a_size_limit(supervised):
    """No request-size limit in Triton 2.51 (``--http-max-input-size`` came later): a 100 KB gzip body is inflated
    to 100 MB and parsed. This documents the gap that the README's proxy (body-size and Content-Encoding limits)
    closes; the server survives this size."""
    server = supervised.server
    raw = b'{"inputs":[{"name":"x","shape":[1],"datatype":"FP32","data":[' + b" " * (100 << 20) + b"1]}]}"
    packed = gzip.compress(raw, 6)
    assert len(packed) < 200_000
    status, answer = http_post(server.http_url, "/v2/models/hift/infer", packed,
                           {"Content-Type": "application/json", "Content-Encoding": "gzip"})
    assert status == 400 and b"unexpected inference input 'x'" in answer  # parsed all 100 MB, then refused
    FIGURES["gzip: compressed bytes inflated and parsed"] = f"{len(packed)} -> {len(raw)}"
    assert server.is_ready()


# ------------------------------------------------------------------------------ dead stages (finding 1)
def _regions(server, model: str | None = None) -> set[Path]:
    """The shared-memory regions (/dev/shm) of the server's live stubs (of ``model``)."""
    from cosyvoice_triton.serving.launch.server import SHM_DIR

    found = {SHM_DIR / s.shm_region for s in server.python_stubs() if s.alive and s.shm_region
             and (model is None or s.model == model)}
    assert found, f"no stub region found for {model or 'the server'}"
    return found


def _no_leftovers(regions: set[Path], what: str) -> None:
    wait_until(lambda: not [p for p in regions if p.exists()], f"no shared-memory region of {what} left")


def test_overflowing_shape_over_http_kills_the_stub_and_it_comes_back(supervised):
    server = supervised.server
    assert _hift_ok(server)
    victims = _regions(server, "hift")
    with ReadinessWatch(server) as watch:
        status, _ = _binary_infer(server, "hift", [{"name": "mel", "shape": [1, 80, OVERFLOW_2_60],
                                                       "datatype": "FP32", "parameters": {"binary_data_size": 0}}])
        assert status >= 400
        FIGURES["http overflow: its answer after (s)"] = round(time.monotonic() - watch.t0, 2)
        _recover(supervised, watch, lambda: _hift_ok(server), "http overflow -> hift stub")
    assert any(e.kind == "reloaded" and e.detail == "hift" for e in supervised.events)
    _no_leftovers(victims, "the dead hift stubs")


def test_overflowing_shape_over_grpc_kills_the_stage_and_it_comes_back(supervised, speech):
    import grpc
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    server = supervised.server
    request = service_pb2.ModelInferRequest(model_name="cosyvoice_vc")
    for name, shape in (("source_audio", [1, OVERFLOW_2_62]), ("prompt_audio", [1, 16000])):
        request.inputs.add(name=name, datatype="FP32", shape=shape)
    for name in ("source_sample_rate", "prompt_sample_rate"):
        request.inputs.add(name=name, datatype="INT32", shape=[1, 1])
    request.raw_input_contents.extend([b"", np.zeros(16000, np.float32).tobytes(),
                                       np.int32(16000).tobytes(), np.int32(16000).tobytes()])
    with ReadinessWatch(server) as watch:
        with grpc.insecure_channel(server.grpc_url) as channel, pytest.raises(grpc.RpcError):
            service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=PATIENCE_S)
        _recover(supervised, watch, lambda: _vc_ok(server, speech), "grpc overflow -> preprocess stub")
    assert any(e.kind == "reloaded" and e.detail == "preprocess" for e in supervised.events)


# ------------------------------------------------------------------------------ server death (finding 2)
def test_deeply_nested_json_kills_the_server_and_it_comes_back(supervised):
    server = supervised.server
    ports = dict(server.ports)
    depth = 100_000
    body = b'{"inputs":[{"name":"mel","shape":[1,80,1],"datatype":"FP32","data":' + b"[" * depth + b"]" * depth
    body += b"}]}"
    victims = _regions(server)
    with ReadinessWatch(server) as watch:
        with pytest.raises((OSError, http.client.HTTPException)):
            http_post(server.http_url, "/v2/models/hift/infer", body, {"Content-Type": "application/json"})
        _recover(supervised, watch, lambda: _hift_ok(server), "nested JSON -> server")
    assert server.ports == ports  # clients reconnect to the same address
    # the event is logged just after the server answers again
    wait_until(lambda: "restarted" in [e.kind for e in supervised.events], "the supervisor's 'restarted' event")
    kinds = [e.kind for e in supervised.events]
    assert "server-exited" in kinds and "restarted" in kinds and supervised.failed is None
    _no_leftovers(victims, "the dead server's stubs")


# ------------------------------------------------------------------------------ no server needed
def test_supervisor_needs_explicit_model_control(tmp_path):
    (tmp_path / "repo").mkdir()
    with pytest.raises(ValueError, match="model_control='explicit'"):
        Supervisor(TritonServer(tmp_path / "repo"))
    with pytest.raises(ValueError, match="max_backoff"):
        Supervisor(TritonServer(tmp_path / "repo", model_control="explicit"), backoff=10, max_backoff=1)


def test_admin_headers_and_restricted_flags(tmp_path, monkeypatch):
    from cosyvoice_triton.serving.launch.server import ADMIN_KEY_ENV, admin_headers, admin_key

    monkeypatch.setenv(ADMIN_KEY_ENV, "k-1_x")
    assert admin_key() == "k-1_x"
    assert admin_headers("http") == {"cosyvoice-admin-key": "k-1_x"}
    assert admin_headers("grpc") == {"triton-grpc-protocol-cosyvoice-admin-key": "k-1_x"}
    monkeypatch.setenv(ADMIN_KEY_ENV, "a=b")
    with pytest.raises(ValueError, match="letters, digits"):
        admin_key()
    monkeypatch.delenv(ADMIN_KEY_ENV)
    drawn = admin_key()
    assert len(drawn) == 48 and admin_key() == drawn  # drawn once per process, then kept in the environment
    (tmp_path / "repo").mkdir()
    server = TritonServer(tmp_path / "repo", admin_key="s3cret", installation=_FAKE_INSTALL)
    flags = [a for a in server.command() if "restricted" in a]
    assert flags == [f"--http-restricted-api={','.join(RESTRICTED_APIS)}:cosyvoice-admin-key=s3cret",
                     f"--grpc-restricted-protocol={','.join(RESTRICTED_APIS)}:cosyvoice-admin-key=s3cret"]
    assert ADMIN_KEY_ENV not in server.environment()  # model code never sees the key
    open_server = TritonServer(tmp_path / "repo", restricted_apis=(), installation=_FAKE_INSTALL)
    assert not [a for a in open_server.command() if "restricted" in a]
    with pytest.raises(ValueError, match="unknown restricted API"):
        TritonServer(tmp_path / "repo", restricted_apis=("shm",))


_FAKE_INSTALL = TritonInstallation(root=Path("/opt/t"), binary=Path("/opt/t/bin/tritonserver"),
                                   backends=Path("/opt/t/backends"), stub=Path("/opt/t/backends/python/stub"),
                                   libs=None, bundled=False)
